"""The jobs of a plan vLLM never bound: its model runner raised before the forward
(`_update_states`, `_prepare_inputs`), then vLLM's fault tolerance aborted every request.

No worker ran the plan's loads or stores, and none will: each rank that skipped it must
report them failed once it binds a later plan, or their pins (and a loading request's
GPU blocks, which vLLM frees only once its load is reported) stay held and the engine
never goes idle. The very first plan may be the one skipped.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    check_quiescent,
    deferred_frees,
    drain,
    kvtier_harness,
    scheduler_side,
)
from test_vllm_bad_disk_slot import record_failed
from test_vllm_fault_before_bind import num_tier_blocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness

PROMPT = list(range(5000, 5065))  # 4 full blocks and a partial one


def abort_all_on_fault(harness: VllmHarness) -> None:
    """Abort every request as vLLM's `fault_tolerant_wrapper` → `on_fault` does."""
    try:
        raise RuntimeError("One or more workers failed")
    except RuntimeError:
        harness.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)


def run_on(harness: VllmHarness, ranks: range, step: SchedulerOutput) -> list[KVConnectorOutput]:
    """Run `step`'s worker calls on `ranks` only (the others raised before binding it)."""
    outputs = []
    for rank in ranks:
        harness.workers[rank].before_forward(step)
        output = harness.workers[rank].after_forward(step)
        assert output is not None
        outputs.append(output)
    return outputs


def apply_outputs(harness: VllmHarness, outputs: list[KVConnectorOutput]) -> None:
    """Hand outputs of a failed step's ranks to the scheduler one by one (stores only:
    vLLM counts a request's finished load once per rank, not per output), as vLLM's
    batch queue drain (`EngineCoreSentinel._drain_batch_queue`) does."""
    harness.wait_for_copies()
    for output in outputs:
        harness.scheduler.update_from_output(
            SchedulerOutput.make_empty(), ModelRunnerOutput.with_kv_conn_output_only(output)
        )


def serve_another(harness: VllmHarness) -> None:
    """Serve a new prompt and drain: its 4 blocks are stored (no fault lingers)."""
    before = num_tier_blocks(harness)
    harness.add_request("d", list(range(7000, 7065)), max_tokens=2)
    drain(harness)
    assert num_tier_blocks(harness) == before + 4


@pytest.mark.parametrize(
    ("num_ranks", "num_skipping"), [(1, 1), (2, 2), (2, 1)], ids=["1-rank", "2-ranks", "rank0-of-2"]
)
def test_stores_of_a_skipped_plan_are_failed_by_the_ranks_that_skipped_it(
    num_ranks: int, num_skipping: int
) -> None:
    harness = kvtier_harness(num_ranks=num_ranks)
    harness.add_request("x", PROMPT, max_tokens=50)
    harness.step()
    skipped = harness.scheduler.schedule()  # stores x's 4 blocks
    assert any(job.is_store for job in skipped.kv_connector_metadata.plan.jobs)
    outputs = run_on(harness, range(num_skipping, num_ranks), skipped)
    abort_all_on_fault(harness)
    apply_outputs(harness, outputs)
    drain(harness, 300)
    assert num_tier_blocks(harness) == 0  # failed on some rank: nothing indexed
    assert not scheduler_side(harness).has_pending_stores()
    check_quiescent(harness)
    serve_another(harness)
    check_quiescent(harness)


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_load_of_a_skipped_plan_is_failed_and_its_request_freed(num_ranks: int) -> None:
    """Every rank reports the load failed to vLLM (`failed_recving`), which frees the
    aborted request's blocks; kvtier's scheduler gives the failure of a load whose request
    finished to no one (a new request may have taken its id: `TransferBook.drop_outcomes`)."""
    harness = kvtier_harness(num_ranks=num_ranks)
    harness.add_request("c", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    reported = [set[str]() for _ in range(num_ranks)]
    for rank in range(num_ranks):
        record_failed(harness, rank, reported[rank], set())
    recomputed: list[str] = []
    side = scheduler_side(harness)
    apply = side.offload.apply_report

    def apply_report(report: object) -> object:
        outcome = apply(report)  # type: ignore[arg-type]
        recomputed.extend(failed.request_id for failed in outcome.failed_loads)
        return outcome

    side.offload.apply_report = apply_report  # type: ignore[method-assign,assignment]
    harness.add_request("a", [*PROMPT, 9], max_tokens=4)
    skipped = harness.scheduler.schedule()  # loads c's 4 blocks for a; no rank binds it
    assert any(job.is_load for job in skipped.kv_connector_metadata.plan.jobs)
    abort_all_on_fault(harness)  # vLLM keeps a's GPU blocks until its load is reported
    drain(harness, 300)
    assert reported == [{"a"}] * num_ranks  # vLLM's load-error path (`failed_recving`)
    assert recomputed == []  # a finished request's load outcome is no one's
    check_quiescent(harness)
    serve_another(harness)
    check_quiescent(harness)


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_skipped_first_plan_fails_the_stores_planned_before_the_fault_was_known(
    num_ranks: int,
) -> None:
    """Overlapped steps: plan 2 stores the blocks plan 1's forward (which never ran)
    was to write. No worker bound a plan before: the skip is still seen."""
    harness = kvtier_harness(num_ranks=num_ranks, **SCHEDULING["async_pipelined"])
    harness.add_request("a", PROMPT, max_tokens=4)
    first = harness.scheduler.schedule()  # a's prefill: every rank raises before binding
    assert first.kv_connector_metadata.plan.step_id == 1
    step_after = harness.scheduler.schedule()  # stores a's 4 (unwritten) blocks
    assert any(job.is_store for job in step_after.kv_connector_metadata.plan.jobs)
    outputs = run_on(harness, range(num_ranks), step_after)
    abort_all_on_fault(harness)
    apply_outputs(harness, outputs)
    drain(harness, 300)
    assert num_tier_blocks(harness) == 0  # nothing of a's was ever computed
    assert not scheduler_side(harness).has_pending_stores()
    assert deferred_frees(harness)  # vLLM's: the skipped steps were never processed
    check_quiescent(harness)
    serve_another(harness)
    check_quiescent(harness)
