"""kvtier's copy of each request's block table stays vLLM's through preemptions.

`StoreSelector.select_scheduled` replaces a table for a new or resumed request and
appends otherwise, as vLLM's model runners do (`gpu_model_runner._update_states`,
`gpu/model_runner.update_requests`; `utils.yield_req_data` says which is which). These
drive the sequences that could break that: preemptions under each scheduling, Model
Runner V2 (a resumed request comes back as a new one), hybrid models (a window's dropped
blocks, Mamba's moved ones), a victim the priority policy had already scheduled in the
same step, `reset_prefix_cache(reset_running_requests=True)` preempting running requests
between two steps (resumed by the next, which names them preempted too), and preemptions
while loads are in flight. Every step `TableMirror` compares the tables with vLLM's; the
harness checks every position a request treats as computed; at the end every tier block
is audited against its key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    PollGate,
    check_quiescent,
    flush_before_polls,
    kvtier_harness,
    offload_worker,
    scheduler_side,
)
from table_mirror import TableMirror, audit_tier
from vllm_engine import KVGroupDef
from vllm_harness import VllmHarness, shared_prefix_prompts

from kvtier.offload.protocols import StepInput, TableUpdate
from kvtier.offload.store_selection import StoreSelector


def run_waves(harness: VllmHarness, prompts: dict[str, list[int]], wave: int, **kw: Any) -> None:
    """Run `prompts` in waves of `wave` requests, each wave until vLLM is idle."""
    items = list(prompts.items())
    for start in range(0, len(items), wave):
        for request_id, prompt in items[start : start + wave]:
            harness.add_request(request_id, prompt, **kw)
        harness.run(2000)


def finish_and_audit(harness: VllmHarness, prompts: dict[str, list[int]]) -> int:
    """Check every request finished and nothing leaked; audit the tier; return its blocks."""
    assert harness.finished >= set(prompts)
    check_quiescent(harness)
    assert harness.scheduler.reset_prefix_cache()
    return audit_tier(harness)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_resumed_requests_tables_are_vllms(scheduling: str, runner: str) -> None:
    # 8 concurrent requests decoding 48 tokens each overflow a 30-block pool; their
    # shared prefixes are stored, so resumed requests load from the tier too.
    harness = kvtier_harness(num_gpu_blocks=30, max_num_seqs=8, **SCHEDULING[scheduling])
    harness.scheduler.use_v2_model_runner = runner == "v2"
    mirror = TableMirror(harness)
    prompts = shared_prefix_prompts(16, prefix_len=64, suffix_len=24, num_prefixes=4)
    run_waves(harness, prompts, wave=8, max_tokens=48)
    counts = mirror.counts
    assert counts["preempted"] > 0
    resumed = "resumed_as_new" if runner == "v2" else "resumed_as_cached"
    assert counts[resumed] > 0, counts
    assert counts["tables_compared"] > 0, counts
    assert counts["resumed_as_cached" if runner == "v2" else "resumed_as_new"] == 0
    assert finish_and_audit(harness, prompts) > 0


HYBRIDS = {  # the second group beside full attention, and a GPU pool it fits
    "window": (KVGroupDef(16, 32), 40),
    "mamba": (KVGroupDef(16, mamba=True), 60),
}


@pytest.mark.parametrize("hybrid", HYBRIDS)
@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_a_hybrid_models_tables_differ_only_where_vllm_moved_blocks(
    scheduling: str, hybrid: str
) -> None:
    """Full attention beside a sliding window or a Mamba state group, through
    preemptions. vLLM nulls the blocks a running request's window drops, in place, and
    sends nothing (its model runner keeps them too): kvtier's copy keeps them. In Mamba's
    "align" mode it moves scratch state blocks of a running request in place (nulled,
    appended again): kvtier reads a state group only from hand-offs, never by position."""
    group, num_gpu_blocks = HYBRIDS[hybrid]
    harness = kvtier_harness(
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=8,
        kv_groups=(KVGroupDef(16), group),
        **SCHEDULING[scheduling],
    )
    mirror = TableMirror(harness)
    prompts = shared_prefix_prompts(16, prefix_len=64, suffix_len=24, num_prefixes=4)
    run_waves(harness, prompts, wave=8, max_tokens=48)
    counts = mirror.counts
    assert counts["preempted"] > 0, counts
    assert counts["resumed_as_cached"] > 0, counts
    assert (counts["window_dropped"] > 0) == (hybrid == "window"), counts
    assert finish_and_audit(harness, prompts) > 0


def test_a_victim_the_priority_policy_scheduled_this_step_is_dropped_whole() -> None:
    """vLLM's priority policy preempts the lowest-priority running request even when it
    was scheduled (and given blocks) earlier in the same step: it leaves that step's
    output, its blocks freed. kvtier sees it only as preempted."""
    harness = kvtier_harness(num_gpu_blocks=30, max_num_seqs=8, scheduling_policy="priority")
    mirror = TableMirror(harness)
    same_step = count_same_step_victims(harness)
    prompts = shared_prefix_prompts(16, prefix_len=64, suffix_len=24, num_prefixes=4)
    items = list(prompts.items())
    for start in range(0, len(items), 8):
        # The oldest requests run first and have the lowest priority: they are the
        # victims of later ones short of blocks.
        for i, (request_id, prompt) in enumerate(items[start : start + 8]):
            harness.add_request(request_id, prompt, max_tokens=48, priority=8 - i)
        harness.run(2000)
    assert same_step["victims"] > 0, same_step
    assert mirror.counts["preempted"] > 0, mirror.counts
    assert mirror.counts["resumed_as_cached"] > 0, mirror.counts
    assert finish_and_audit(harness, prompts) > 0


def count_same_step_victims(harness: VllmHarness) -> dict[str, int]:
    """Count requests vLLM gave blocks and then preempted within one `schedule`."""
    scheduler = harness.scheduler
    manager = scheduler.kv_cache_manager
    allocate, schedule = manager.allocate_slots, scheduler.schedule
    allocated: set[str] = set()
    counts = {"victims": 0}

    def recording_allocate(request: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = allocate(request, *args, **kwargs)
        if blocks is not None and request.status.name == "RUNNING":
            allocated.add(request.request_id)
        return blocks

    def recording_schedule(*args: Any, **kwargs: Any) -> Any:
        allocated.clear()
        output = schedule(*args, **kwargs)
        counts["victims"] += len(allocated & set(output.preempted_req_ids or ()))
        return output

    manager.allocate_slots = recording_allocate  # type: ignore[method-assign]
    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_a_reset_preempting_running_requests_between_steps(scheduling: str, runner: str) -> None:
    """`reset_prefix_cache(reset_running_requests=True)` preempts every running request
    outside `schedule`; the next output both names them preempted and resumes them. With
    overlapped steps a step is in flight at the reset: vLLM defers freeing the blocks it
    may write, so the reset itself fails (RuntimeError), the requests preempted all the
    same; the in-flight step's output for them comes back after they resumed."""
    harness = kvtier_harness(**SCHEDULING[scheduling])
    harness.scheduler.use_v2_model_runner = runner == "v2"
    flush_before_polls(offload_worker(harness))  # no copy in flight at a reset
    mirror = TableMirror(harness)
    prompts = shared_prefix_prompts(6, prefix_len=64, suffix_len=24, num_prefixes=2)
    for request_id, prompt in prompts.items():
        harness.add_request(request_id, prompt, max_tokens=24)
    num_resets = 0
    for index in range(200):
        if not harness.is_busy():
            break
        harness.step()
        if index % 5 == 4 and harness.scheduler.running:
            try:
                assert harness.scheduler.reset_prefix_cache(reset_running_requests=True)
            except RuntimeError:  # blocks held for the step in flight
                assert scheduling == "async_pipelined"
            num_resets += 1
    assert num_resets > 0
    harness.run(2000)
    counts = mirror.counts
    resumed = counts["resumed_as_new"] + counts["resumed_as_cached"]
    assert counts["preempted"] > 0, counts
    assert resumed > 0, counts
    finish_and_audit(harness, prompts)


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_requests_preempted_while_loads_are_in_flight(scheduling: str) -> None:
    """Running requests preempt each other while others wait for their tier loads (held
    back, so the loads stay in flight for as long as the preemptions take); the loading
    requests hold their blocks and are resumed from a whole table once loaded."""
    harness = kvtier_harness(num_gpu_blocks=30, max_num_seqs=8, **SCHEDULING[scheduling])
    mirror = TableMirror(harness)
    stored = shared_prefix_prompts(4, prefix_len=64, suffix_len=8, num_prefixes=4, seed=1)
    harness.run_requests(stored, max_tokens=2)
    assert harness.scheduler.reset_prefix_cache()  # the next hits come from the tier
    gate = PollGate(offload_worker(harness))
    gate.hold("load")
    decoders = shared_prefix_prompts(4, prefix_len=16, suffix_len=16, num_prefixes=4, seed=2)
    for request_id, prompt in decoders.items():
        harness.add_request(f"decode-{request_id}", prompt, max_tokens=80)
    harness.step()
    for request_id, prompt in stored.items():
        harness.add_request(f"hit-{request_id}", [*prompt, 7, 7], max_tokens=8)
    for _ in range(60):
        harness.step()
    preempted_while_loading = mirror.counts["preempted_while_loading"]
    gate.release()
    harness.run(2000)
    assert preempted_while_loading > 0, mirror.counts
    assert mirror.counts["resumed_as_cached"] > 0, mirror.counts
    assert all(harness.external_hit_tokens(f"hit-{r}") == 64 for r in stored)
    finish_and_audit(harness, stored)


def test_a_misaligned_table_costs_stores_never_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why a misaligned table could not store wrong KV anyway: a store is keyed by the
    hash vLLM's pool gives the GPU block when it is selected (`StoreQueueing.try_select`)
    and registered under the one it holds when the copy lands, never by the position in
    kvtier's table; vLLM hashes a block only for tokens whose KV its forward writes
    before kvtier's worker copies (`wait_for_save`). Here kvtier is made to append every
    table and never reset one (as if vLLM resent a resumed request's table as an append,
    its preemption unnoticed): its tables go wrong, the tier's contents do not."""
    monkeypatch.setattr(StoreSelector, "reset_request", lambda self, request_id: None)
    harness = kvtier_harness(num_gpu_blocks=30, max_num_seqs=8)
    offload = scheduler_side(harness).offload
    build_plan = offload.build_plan
    misaligned: set[str] = set()

    def appending(step: StepInput) -> Any:
        scheduled = tuple(item._replace(table_update=TableUpdate.APPEND) for item in step.scheduled)
        plan = build_plan(dataclasses.replace(step, scheduled=scheduled))
        manager = harness.scheduler.kv_cache_manager
        for item in step.scheduled:
            request_id = item.request.request_id
            state = offload.selector.tracked.get(request_id)
            if state is not None and state.block_ids != list(
                map(list, manager.get_block_ids(request_id))
            ):
                misaligned.add(request_id)
        return plan

    offload.build_plan = appending  # type: ignore[method-assign]
    prompts = shared_prefix_prompts(16, prefix_len=64, suffix_len=24, num_prefixes=4)
    run_waves(harness, prompts, wave=8, max_tokens=48)
    assert misaligned, "no table went wrong"
    assert finish_and_audit(harness, prompts) > 0
