"""`KVTierConnector` under vLLM's fault tolerance (`enable_fault_tolerance`).

A forward that raises leaves its blocks unwritten, yet vLLM's model runner still calls
the connector's `start_load_kv` and `wait_for_save` (the `finally` of its KV connector
context), and its engine core then aborts every request from the exception handler of
its busy loop (`EngineCoreSentinel.on_fault`). vLLM counted the failed step's tokens as
computed when it scheduled them: kvtier must not store those blocks. With several
ranks, vLLM drops the output of a rank whose forward raised and hands the other ranks'
outputs, their KV events removed, to the next step's aggregate.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    PollGate,
    check_quiescent,
    drain,
    kvtier_harness,
    offload_worker,
    scheduler_side,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness
from vllm_workers import WorkerSide

from kvtier.offload.plan import Tier

PROMPT = list(range(1000, 1065))  # 4 full blocks and a partial one


def raising_forward(harness: VllmHarness, scheduler_output: SchedulerOutput) -> None:
    """Raise from the forward, calling the worker roles as vLLM's model runner does."""
    try:
        raise RuntimeError("forward failed")  # nothing written into the KV cache
    finally:  # vLLM's `_get_kv_connector_output`
        for worker in harness.workers:
            worker.after_forward(scheduler_output)


def launch(harness: VllmHarness) -> SchedulerOutput:
    """Schedule a step and start its forward: every rank's before-forward calls."""
    scheduler_output = harness.scheduler.schedule()
    for worker in harness.workers:
        worker.before_forward(scheduler_output)
    return scheduler_output


def failed_forward(harness: VllmHarness) -> None:
    """Schedule a step whose forward raises."""
    scheduler_output = launch(harness)
    with pytest.raises(RuntimeError, match="forward failed"):
        raising_forward(harness, scheduler_output)


def fault_abort(harness: VllmHarness) -> None:
    """Abort every request the way vLLM's engine core does after a failed step."""
    try:
        raise RuntimeError("One or more workers failed")
    except RuntimeError:  # vLLM's `fault_tolerant_wrapper` → `on_fault`
        harness.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize(("num_ranks", "store_mode"), [(1, "eager"), (2, "eager"), (1, "lazy")])
def test_blocks_of_a_failed_forward_are_never_stored(
    num_ranks: int, store_mode: str, reset: bool
) -> None:
    """Lazy mode too (regression): vLLM frees the aborted request's blocks with their
    hashes (it hashes blocks as it schedules them), and the lazy walk, run by the steps
    of the requests that came next, stored them from the GPU free queue; after a tier
    reset too (it forgot they were held back)."""
    harness = kvtier_harness(num_ranks=num_ranks, extra={"store_mode": store_mode})
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)  # c's KV is left in the GPU blocks the next request gets
    harness.add_request("a", PROMPT, max_tokens=4)
    failed_forward(harness)
    fault_abort(harness)
    if reset:
        assert harness.scheduler.reset_connector_cache()
    later = list(range(7000, 7200))  # 12 full blocks
    harness.add_request("d", later, max_tokens=8)
    drain(harness)  # d's steps: a lazy walk passes a's freed blocks
    harness.add_request("x", list(range(9000, 9065)), max_tokens=8)
    drain(harness)  # x's steps: a lazy walk stores d's blocks
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU cache only
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)
    drain(harness)  # KVMismatchError if a's unwritten blocks were stored and served
    assert harness.external_hit_tokens("b") == 0
    harness.add_request("e", [*later, 7], max_tokens=2)
    drain(harness)
    assert harness.external_hit_tokens("e") == 192  # stores run again after the fault
    check_quiescent(harness)


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_a_local_hit_on_a_block_the_failed_step_computed_is_never_stored(store_mode: str) -> None:
    """Regression (eager): a2's first block is a local hit on a1's, which the same
    prefill step computes. The step's plan carries the store of a2's hit block; the
    forward fails, and vLLM still calls `wait_for_save` (from a `finally`), which
    submitted that store: it copied KV never computed."""
    harness = kvtier_harness(extra={"store_mode": store_mode})
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)  # c's KV is left in the GPU blocks the next requests get
    prefix = list(range(1000, 1016))  # one full block
    harness.add_request("a1", [*prefix, *range(2000, 2021)], max_tokens=21)
    harness.add_request("a2", [*prefix, *range(3000, 3021)], max_tokens=21)
    failed_forward(harness)
    fault_abort(harness)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU cache only
    harness.add_request("b", [*prefix, 7], max_tokens=2)
    drain(harness)  # KVMismatchError if the shared block was stored and served
    assert harness.external_hit_tokens("b") == 0
    check_quiescent(harness)


def test_an_abort_outside_a_fault_still_stores_the_computed_blocks() -> None:
    harness = kvtier_harness()
    harness.add_request("a", PROMPT, max_tokens=50)
    for _ in range(3):
        harness.step()
    harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)
    drain(harness)
    assert harness.external_hit_tokens("b") == 64
    check_quiescent(harness)


def num_tier_blocks(harness: VllmHarness) -> int:
    """Return how many blocks the CPU tier holds under a key."""
    pool = scheduler_side(harness).offload.index.pools[Tier.CPU]
    return sum(pool.is_cached(block) for block in range(1, pool.num_blocks))


def test_stores_planned_before_the_fault_was_known_are_failed() -> None:
    """Overlapped steps: step N+1 is planned (storing N's blocks) and run before N's
    failure reaches the engine core; vLLM feeds N+1's connector output to the scheduler
    after the fault (`EngineCoreSentinel._drain_batch_queue`)."""
    harness = kvtier_harness(**SCHEDULING["async_pipelined"])
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    assert num_tier_blocks(harness) == 4
    harness.add_request("a", PROMPT, max_tokens=4)
    failed_forward(harness)
    step_after = harness.scheduler.schedule()  # its plan stores a's 4 (unwritten) blocks
    assert any(job.is_store for job in step_after.kv_connector_metadata.plan.jobs)
    (worker,) = harness.workers
    worker.before_forward(step_after)
    kv_output = worker.after_forward(step_after)
    fault_abort(harness)
    harness.wait_for_copies()
    harness.scheduler.update_from_output(
        SchedulerOutput.make_empty(), ModelRunnerOutput.with_kv_conn_output_only(kv_output)
    )
    for _ in range(3):
        harness.step()
    harness.wait_for_copies()
    harness.step()
    assert num_tier_blocks(harness) == 4  # c's only: a's blocks hold c's KV
    side = scheduler_side(harness)
    assert not side.has_pending_stores()
    assert side.num_tracked_requests == 0
    harness.add_request("d", list(range(7000, 7065)), max_tokens=2)
    drain(harness)
    assert num_tier_blocks(harness) == 8  # stores run again once the fault is known


def apply_output(harness: VllmHarness, kv_output: KVConnectorOutput | None) -> None:
    """Feed one step's connector output to the scheduler as vLLM's batch queue drain
    (`EngineCoreSentinel._drain_batch_queue`) does, in its very words: not a rank's reply
    (`forward_faults.rank_reply`), as no aggregator writes into it."""
    harness.scheduler.update_from_output(
        SchedulerOutput.make_empty(), ModelRunnerOutput.with_kv_conn_output_only(kv_output)
    )


def settle_after_fault(harness: VllmHarness, kv_output: KVConnectorOutput | None) -> None:
    """Abort every request as vLLM does after a failed step, feed it the overlapped
    step's output (`kv_output`), and step until every store planned has been reported."""
    fault_abort(harness)
    harness.wait_for_copies()
    apply_output(harness, kv_output)
    for _ in range(3):
        harness.step()
    harness.wait_for_copies()
    harness.step()


def check_stores_resume(harness: VllmHarness) -> None:
    """A new request's 4 blocks are stored (the tier held 4 before): the scheduler role
    knows every fault, so no plan is failed any more; nothing is left pinned."""
    harness.add_request("d", list(range(7000, 7065)), max_tokens=2)
    drain(harness)
    assert num_tier_blocks(harness) == 8
    check_quiescent(harness)


def test_stores_planned_before_a_second_fault_was_known_are_failed() -> None:
    """Regression: overlapped steps, two faults. The plan after the second failed step
    (storing its unwritten blocks) is built after the scheduler role learned of the
    first fault but before it learned of the second. The worker compared the count of
    faults the plan knew (bumped by the first) with the one current when the second
    forward's plan was built (before the bump), took the plan for one built after the
    second fault, and stored c's KV under a's keys (8 tier blocks, not 4)."""
    harness = kvtier_harness(**SCHEDULING["async_pipelined"])
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    assert num_tier_blocks(harness) == 4
    (worker,) = harness.workers
    harness.add_request("w", list(range(3000, 3020)), max_tokens=4)
    failed_forward(harness)  # the first fault
    overlapped = harness.scheduler.schedule()  # planned before the first fault was known
    worker.before_forward(overlapped)
    first_report = worker.after_forward(overlapped)  # tells the scheduler of the first fault
    fault_abort(harness)
    harness.add_request("a", PROMPT, max_tokens=4)
    failed_forward(harness)  # the second fault: a's prefill writes nothing
    apply_output(harness, first_report)  # the first fault is known from here on
    step_after = harness.scheduler.schedule()  # its plan stores a's 4 (unwritten) blocks
    assert any(job.is_store for job in step_after.kv_connector_metadata.plan.jobs)
    worker.before_forward(step_after)
    kv_output = worker.after_forward(step_after)
    settle_after_fault(harness, kv_output)
    assert num_tier_blocks(harness) == 4  # c's only: a's blocks hold c's KV
    check_stores_resume(harness)  # once both faults are known


def test_what_finished_during_a_failed_step_is_reported_in_the_next() -> None:
    """vLLM drops the connector output of a step whose forward raised."""
    harness = kvtier_harness()
    gate = PollGate(offload_worker(harness))
    gate.hold("store")
    harness.add_request("x", list(range(5000, 5065)), max_tokens=50)
    for _ in range(3):
        harness.step()  # x's 4 blocks are stored, their completion held back
    harness.wait_for_copies()
    gate.release()  # reported at the next poll
    harness.add_request("a", PROMPT, max_tokens=4)
    failed_forward(harness)
    fault_abort(harness)
    drain(harness)  # "engine still busy" if the stores' completion was lost
    assert num_tier_blocks(harness) == 4
    check_quiescent(harness)


def raising_forward_deferring_save(harness: VllmHarness, scheduler_output: SchedulerOutput) -> None:
    """Raise from the forward with speculative decoding: vLLM defers `wait_for_save`
    (and clearing the metadata) past the drafter, which never runs."""
    try:
        raise RuntimeError("forward failed")
    finally:
        for worker in harness.workers:
            connector = worker.connector
            connector.start_load_kv(None)  # type: ignore[arg-type]
            connector.get_transfer_results(scheduler_output.finished_req_ids)
            connector.build_connector_worker_meta()


def test_stores_vllm_never_asked_to_save_are_failed() -> None:
    harness = kvtier_harness()
    harness.add_request("x", list(range(5000, 5065)), max_tokens=50)
    harness.step()  # x's prefill: its blocks are stored in the next step's plan
    scheduler_output = harness.scheduler.schedule()
    assert any(job.is_store for job in scheduler_output.kv_connector_metadata.plan.jobs)
    for worker in harness.workers:
        worker.before_forward(scheduler_output)
    with pytest.raises(RuntimeError, match="forward failed"):
        raising_forward_deferring_save(harness, scheduler_output)
    fault_abort(harness)
    drain(harness)  # "engine still busy" while the stores were pending
    check_quiescent(harness)


def raise_from_forward(worker: WorkerSide, scheduler_output: SchedulerOutput) -> None:
    """Raise from one rank's forward, calling its worker role as vLLM's model runner."""
    try:
        raise RuntimeError("forward failed")
    finally:
        worker.after_forward(scheduler_output)


def failed_forward_on_one_rank(harness: VllmHarness, failing_rank: int) -> None:
    """Schedule a step whose forward raises on `failing_rank` only, the others' outputs
    salvaged as vLLM's multiproc executor does (`ft_defer_kv_connector_outputs`): they
    join the next step's aggregate, their KV events dropped."""
    scheduler_output = harness.scheduler.schedule()
    for worker in harness.workers:
        worker.before_forward(scheduler_output)
    salvaged = []
    for rank, worker in enumerate(harness.workers):
        if rank == failing_rank:
            with pytest.raises(RuntimeError, match="forward failed"):
                raise_from_forward(worker, scheduler_output)
        else:
            salvaged.append(worker.after_forward(scheduler_output))
    harness._aggregator.ft_defer_kv_connector_outputs(salvaged)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_healthy_rank_s_report_of_a_failed_step_arrives_a_step_late(failing_rank: int) -> None:
    """Stores whose completion each rank polls during the step that failed on one rank:
    the healthy rank's report comes salvaged at the next step, the failing rank's again
    from its worker; both count once, and the blocks are served."""
    harness = kvtier_harness(num_ranks=2)
    gates = [PollGate(offload_worker(harness, rank)) for rank in range(2)]
    for gate in gates:
        gate.hold("store")
    harness.add_request("x", list(range(5000, 5065)), max_tokens=50)
    for _ in range(3):
        harness.step()  # x's 4 blocks are stored on both ranks, their completion held
    harness.wait_for_copies()
    assert num_tier_blocks(harness) == 0
    for gate in gates:
        gate.release()  # reported at the next poll: that of the failing step
    harness.add_request("a", PROMPT, max_tokens=4)
    failed_forward_on_one_rank(harness, failing_rank)
    fault_abort(harness)
    drain(harness)  # "engine still busy" if either rank's completion was lost
    assert num_tier_blocks(harness) == 4
    check_quiescent(harness)
    assert harness.scheduler.reset_prefix_cache()
    harness.add_request("b", [*range(5000, 5065), 7], max_tokens=2)
    drain(harness)
    assert harness.external_hit_tokens("b") == 64
    check_quiescent(harness)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_load_finishing_during_a_step_failed_on_one_rank_releases_its_pins(
    failing_rank: int,
) -> None:
    """A request waiting for its load when the step fails on one rank, and is aborted:
    vLLM frees it once every rank reported the load, the healthy rank's report salvaged
    into the next step."""
    harness = kvtier_harness(num_ranks=2)
    harness.add_request("x", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    gates = [PollGate(offload_worker(harness, rank)) for rank in range(2)]
    for gate in gates:
        gate.hold("load")
    harness.add_request("b", [*range(5000, 5065), 7], max_tokens=4)
    harness.step()  # b's 64 tokens load on both ranks, their completion held
    assert harness.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    harness.wait_for_copies()
    for gate in gates:
        gate.release()
    failed_forward_on_one_rank(harness, failing_rank)
    fault_abort(harness)
    drain(harness)  # "engine still busy" while b waits for a load report
    check_quiescent(harness)
    harness.add_request("c", [*range(5000, 5065), 8], max_tokens=2)
    drain(harness)
    assert harness.external_hit_tokens("c") + harness.local_hit_tokens("c") >= 64
    check_quiescent(harness)
