"""A worker's bind of a step's connector metadata that raises partway.

vLLM's model runner binds the metadata before the forward, outside the `try` whose
`finally` calls the connector's after-forward part (Model Runner V1), or in
`pre_forward` (V2): a bind that raises ends the step on that rank, and vLLM's fault
tolerance aborts every request. No step of vLLM 0.33 makes kvtier's bind raise, but an
interrupt or a `MemoryError` may come from any line of it. Whatever it did by then, the
plan must count as one the rank never bound (`test_vllm_skipped_plan`): its jobs
reported failed by the next bind, its step a failed forward's. On the code before this
test a bind cut short after taking the plan left it bound as if it had run: the next
bind failed none of its jobs (an aborted request's load was never reported: vLLM kept
its GPU blocks and never went idle), and the next plan's stores, built before the fault
was known, copied blocks that plan's forward never wrote into the tier under the
prefix's keys.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    PollGate,
    check_quiescent,
    drain,
    kvtier_harness,
    kvtier_worker,
    offload_worker,
    scheduler_side,
)
from test_vllm_fault_before_bind import num_tier_blocks
from test_vllm_skipped_plan import PROMPT, abort_all_on_fault, apply_outputs, run_on, serve_another
from vllm_harness import VllmHarness

from kvtier.adapters.vllm import worker_side
from kvtier.adapters.vllm.worker_side import WorkerSide
from kvtier.offload.plan import Tier

# The calls of `WorkerSide.bind` on data it does not own, in the order the code before
# this test made them: the outbox's acknowledgement, then the load tracker's update.
CALLS = {"acknowledge": ("outbox", "acknowledge"), "loads": ("loads", "update")}


def raise_in_bind(harness: VllmHarness, rank: int, call: str, monkeypatch: Any) -> None:
    """Make one call of the rank's next bind raise `MemoryError` (once)."""
    side: WorkerSide = kvtier_worker(harness, rank).connector.worker_side  # type: ignore[attr-defined]
    owner_name, method = CALLS[call]
    owner = getattr(side, owner_name)
    real = getattr(owner, method)

    def raising(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(owner, method, real)
        raise MemoryError("bind cut short")

    monkeypatch.setattr(owner, method, raising)


def bind_raising(harness: VllmHarness, ranks: range, step: Any) -> None:
    """Run `step` on `ranks`, whose bind raises (vLLM calls nothing more there)."""
    for rank in ranks:
        with pytest.raises(MemoryError):
            harness.workers[rank].before_forward(step)


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_stores_planned_after_a_bind_that_raised_are_failed(
    call: str, num_ranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overlapped steps: the plan after the one whose bind raised on rank 0 stores the
    blocks that step's forward was to write; rank 0 must fail those stores."""
    harness = kvtier_harness(num_ranks=num_ranks, **SCHEDULING["async_pipelined"])
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)  # c's KV is left in the GPU blocks the next request gets
    assert num_tier_blocks(harness) == 4
    harness.add_request("a", list(range(1000, 1065)), max_tokens=4)
    failed_step = harness.scheduler.schedule()  # a's prefill
    raise_in_bind(harness, 0, call, monkeypatch)
    bind_raising(harness, range(1), failed_step)
    outputs = run_on(harness, range(1, num_ranks), failed_step)
    step_after = harness.scheduler.schedule()  # stores a's 4 blocks
    assert any(job.is_store for job in step_after.kv_connector_metadata.plan.jobs)
    outputs += run_on(harness, range(num_ranks), step_after)
    abort_all_on_fault(harness)
    apply_outputs(harness, outputs)
    drain(harness, 300)
    assert num_tier_blocks(harness) == 4  # c's only: a's blocks hold c's KV on rank 0
    check_quiescent(harness)
    serve_another(harness)
    check_quiescent(harness)


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_load_of_a_plan_whose_bind_raised_is_failed_and_its_request_freed(
    call: str, num_ranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's bind of the plan loading a's hit raises; vLLM aborts a but keeps its
    GPU blocks until every rank reported its load."""
    harness = kvtier_harness(num_ranks=num_ranks)
    harness.add_request("c", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    harness.add_request("a", [*PROMPT, 9], max_tokens=4)
    failed_step = harness.scheduler.schedule()  # loads c's 4 blocks for a
    assert any(job.is_load for job in failed_step.kv_connector_metadata.plan.jobs)
    for rank in range(num_ranks):
        raise_in_bind(harness, rank, call, monkeypatch)
    bind_raising(harness, range(num_ranks), failed_step)
    abort_all_on_fault(harness)
    drain(harness, 300)  # "engine still busy" while vLLM waits for a's load
    check_quiescent(harness)
    serve_another(harness)
    check_quiescent(harness)


def test_a_bind_raising_after_a_v2_failed_forward_fails_that_plans_load_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Model Runner V2: a's loading step raised in rank 0's forward (nothing called
    after `pre_forward`), while rank 1's load still runs. Rank 0's next bind, which fails
    that plan's load, raises on taking its own plan; the bind after it must not fail the
    load again: the scheduler role counts reports against the ranks, and a second one
    from rank 0 would end the load (its tier blocks unpinned) while rank 1 still reads
    them."""
    harness = kvtier_harness(num_ranks=2)
    harness.add_request("c", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    gate = PollGate(offload_worker(harness, 1))
    gate.hold("load")
    harness.add_request("a", [*PROMPT, 9], max_tokens=4)
    loading = harness.scheduler.schedule()  # loads c's 4 blocks for a
    (load,) = [job for job in loading.kv_connector_metadata.plan.jobs if job.is_load]
    harness.workers[0].before_forward(loading)  # then its forward raises: nothing more
    outputs = run_on(harness, range(1, 2), loading)
    abort_all_on_fault(harness)  # vLLM keeps a's GPU blocks until its load is reported
    apply_outputs(harness, outputs)
    failed_step = harness.scheduler.schedule()
    real_replace = worker_side.replace

    def replace_raising(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(worker_side, "replace", real_replace)
        raise MemoryError("bind cut short")

    monkeypatch.setattr(worker_side, "replace", replace_raising)
    bind_raising(harness, range(1), failed_step)
    outputs = run_on(harness, range(1, 2), failed_step)
    abort_all_on_fault(harness)
    apply_outputs(harness, outputs)
    harness.step()  # rank 0 reports a's load failed
    tier = scheduler_side(harness).offload.index.pools[Tier.CPU]
    assert all(tier.ref_count(block) for block in load.src_block_ids)  # rank 1 reads them
    gate.release()
    drain(harness, 300)
    check_quiescent(harness)
    serve_another(harness)
    check_quiescent(harness)
