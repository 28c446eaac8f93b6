"""Lazy mode learns of every GPU block a vLLM request uses before the walk (SPEC §6.6).

The walk's memory (blocks copied, being copied, waiting for a tier slot, its cursor)
must drop a block once a request uses it: kept, a block reused and freed again would be
skipped as stored before, and a cursor on it would make the next walk skip the whole
free queue. `update_state_after_alloc` notes the blocks of a request waiting for its
load (vLLM schedules it steps later); those of a request vLLM runs in the step that
allocated them are noted once, by that step's plan (`OffloadScheduler.on_allocated`'s
`scheduled`). This test pins vLLM's call order under that split: right after every
plan, no block of a running or loading request is in the walk's memory.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import SCHEDULING, check_quiescent, kvtier_harness, scheduler_side
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness, shared_prefix_prompts

from kvtier.core.pool_block import NULL_BLOCK_ID

IN_USE = (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)


def check_after_every_plan(harness: VllmHarness) -> dict[RequestStatus, int]:
    """Check the walk's memory against vLLM's tables after each plan; return how many
    requests of each status in `IN_USE` were checked."""
    side = scheduler_side(harness)
    build, lazy = side.build_metadata, side.offload.selector.lazy
    scheduler = harness.scheduler
    seen = dict.fromkeys(IN_USE, 0)

    def build_metadata(scheduler_output: Any) -> Any:
        meta = build(scheduler_output)
        remembered = lazy.stored.keys() | lazy.copying | lazy.deferred
        for req_id, request in scheduler.requests.items():
            if request.status not in IN_USE:
                continue
            seen[request.status] += 1
            tables = scheduler.kv_cache_manager.get_block_ids(req_id)
            in_use = {b for table in tables for b in table if b != NULL_BLOCK_ID}
            assert not in_use & remembered, (req_id, request.status, in_use & remembered)
            assert lazy.cursor not in in_use, (req_id, request.status, lazy.cursor)
        return meta

    side.build_metadata = build_metadata  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_no_block_in_use_stays_in_the_walks_memory(scheduling: str) -> None:
    """Rounds of requests sharing prefixes on a tight GPU pool (preemptions), each round
    after a GPU prefix-cache reset: its requests load their prefixes from the tier
    (loading requests) into blocks the walk copied and remembers."""
    harness = kvtier_harness(
        num_cpu_blocks=64,
        num_gpu_blocks=40,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        extra={"store_mode": "lazy"},
        **SCHEDULING[scheduling],
    )
    seen = check_after_every_plan(harness)
    side = scheduler_side(harness)
    hits = 0
    for round_ in range(4):
        prompts = shared_prefix_prompts(6, prefix_len=64, suffix_len=40, num_prefixes=2)
        for req_id, prompt in prompts.items():
            harness.add_request(f"{round_}-{req_id}", prompt, max_tokens=24)
        for _ in range(400):
            if not harness.is_busy():
                break
            harness.step()
            side.offload.check_invariants()
        assert not harness.is_busy()
        hits += sum(harness.external_hit_tokens(f"{round_}-{r}") for r in prompts)
        assert harness.scheduler.reset_prefix_cache()
    check_quiescent(harness)
    harness.close()
    # The example exercised what it checks: loads from the tier and both statuses.
    assert hits > 0
    assert all(seen.values()), seen
