"""A connector reset (`reset_cache`) while a request waits for its load from the tier.

vLLM's `reset_prefix_cache(reset_connector=True)` and `reset_connector_cache()` reach
`KVTierConnector.reset_cache` between two steps, whatever the requests are doing. Here a
request waits (`WAITING_FOR_REMOTE_KVS`) for a load that is either issued and held in
flight (`PollGate`), or allocated but not yet issued (vLLM's deferred loads). Either
way the reset must report False while the load is outstanding, serve nothing stored
before it to a later request, let the waiting request finish (the harness checks every
position it treats as computed: `KVMismatchError` on wrong KV), leak no pin or GPU block
(`check_quiescent`), and leave only correct KV in the tier (`audit_tier`). Each run is
bounded by `drain`'s step limit, so a request stuck waiting fails instead of hanging.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    SLOT_BYTES,
    PollGate,
    check_quiescent,
    drain,
    kvtier_harness,
    offload_worker,
    scheduler_side,
)
from table_mirror import audit_tier
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness, shared_prefix_prompts

PROMPTS = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
AGAIN = {f"again-{r}": [*p, 9] for r, p in PROMPTS.items()}
LATER = {f"later-{r}": [*p, 8] for r, p in PROMPTS.items()}


def stored_then_gpu_reset(tier: str, tmp_path: Path, **overrides: Any) -> VllmHarness:
    """Return a harness whose tier holds 3 blocks of each prompt and whose GPU cache is
    empty; `tier` "cpu" or "cascade" (a 6-block CPU tier written through to disk:
    the earlier prompts are served from disk)."""
    if tier == "cascade":
        extra = {
            "disk_bytes": 256 * SLOT_BYTES,
            "disk_path": str(tmp_path),
            "disk_io_mode": "page_cache",
            "cascade": "write_through",
        }
        harness = kvtier_harness(num_cpu_blocks=7, extra=extra, **overrides)
    else:
        harness = kvtier_harness(**overrides)
    for request_id, prompt in PROMPTS.items():  # one by one: each store finds free slots
        harness.run_requests({request_id: prompt}, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()
    return harness


def reset_connector(harness: VllmHarness, how: str) -> bool:
    """Reset the connector the way `how` names; return what vLLM returned."""
    if how == "connector_only":
        return harness.scheduler.reset_connector_cache()
    # vLLM's own reset fails too (the waiting request holds GPU blocks): False either way.
    return harness.scheduler.reset_prefix_cache(reset_connector=True)


def finish_and_check(harness: VllmHarness, waiting: str) -> None:
    """Let everything finish; check the waiting request finished, nothing leaked, nothing
    from before the reset is served, and the tier holds only correct KV."""
    drain(harness)  # AssertionError after its step limit: nothing hangs
    assert waiting in harness.finished
    assert waiting not in harness.scheduler.requests
    check_quiescent(harness)
    harness.run_requests(LATER, max_tokens=3)
    assert all(harness.external_hit_tokens(r) == 0 for r in LATER), "KV from before served"
    check_quiescent(harness)
    assert harness.scheduler.reset_prefix_cache()
    audit_tier(harness)


@pytest.mark.parametrize("how", ["connector_only", "with_prefix_cache"])
@pytest.mark.parametrize("tier", ["cpu", "cascade"])
@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_a_reset_while_an_issued_load_is_in_flight(
    scheduling: str, tier: str, how: str, tmp_path: Path
) -> None:
    harness = stored_then_gpu_reset(tier, tmp_path, **SCHEDULING[scheduling])
    gate = PollGate(offload_worker(harness))
    gate.hold("load")
    harness.add_request("b", AGAIN["again-req-1"], max_tokens=3)
    for _ in range(3):
        harness.step()
    side = scheduler_side(harness)
    assert harness.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not side.offload.loads.queued, "the load was not issued"
    assert not reset_connector(harness, how), "a load is in flight"
    for _ in range(3):  # the load stays held: the request keeps waiting, holding its blocks
        harness.step()
    assert harness.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    gate.release()
    finish_and_check(harness, "b")
    assert harness.external_hit_tokens("b") == 48  # offered before the reset


@pytest.mark.parametrize("how", ["connector_only", "with_prefix_cache"])
@pytest.mark.parametrize("tier", ["cpu", "cascade"])
def test_a_reset_while_a_deferred_load_is_not_yet_issued(
    tier: str, how: str, tmp_path: Path
) -> None:
    """vLLM defers an async load's allocation callback to `update_from_output`
    (`defer_async_loads`), so between two steps the load is allocated but unissued: the
    reset drops it, and it comes back as a failed load that vLLM recomputes."""
    harness = stored_then_gpu_reset(tier, tmp_path, **SCHEDULING["async_pipelined"])
    scheduler = harness.scheduler
    scheduler.defer_async_loads = True
    harness.add_request("c", list(range(2000, 2100)), max_tokens=40)  # keeps steps in flight
    harness.step()
    harness.add_request("b", AGAIN["again-req-0"], max_tokens=3)
    side = scheduler_side(harness)
    for _ in range(20):
        harness.step()
        if side.offload.loads.queued:
            break
    assert [load.request_id for load in side.offload.loads.queued] == ["b"], "not deferred"
    assert scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    reset_connector(harness, how)  # True or not: the unissued load is dropped either way
    assert not side.offload.loads.queued
    finish_and_check(harness, "b")
    assert "c" in harness.finished
