"""A forward step that raises in vLLM's model runner before it binds the connector
metadata (`_update_states`, `_prepare_inputs`: before `maybe_get_kv_connector_output`).

The worker roles never see that step's plan; with overlapped steps the next plan, built
before the failure reached the engine core, stores the failed step's (unwritten) blocks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import SCHEDULING, drain, kvtier_harness, scheduler_side
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness

from kvtier.offload.plan import Tier

PROMPT = list(range(1000, 1065))  # 4 full blocks and a partial one


def num_tier_blocks(harness: VllmHarness) -> int:
    """Return how many blocks the CPU tier holds under a key."""
    pool = scheduler_side(harness).offload.index.pools[Tier.CPU]
    return sum(pool.is_cached(block) for block in range(1, pool.num_blocks))


def test_stores_planned_after_a_step_that_failed_before_binding_are_failed() -> None:
    harness = kvtier_harness(**SCHEDULING["async_pipelined"])
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)  # c's KV is left in the GPU blocks the next request gets
    assert num_tier_blocks(harness) == 4
    harness.add_request("a", PROMPT, max_tokens=4)
    harness.scheduler.schedule()  # a's prefill: the model runner raises before binding
    step_after = harness.scheduler.schedule()  # stores a's 4 (unwritten) blocks
    assert any(job.is_store for job in step_after.kv_connector_metadata.plan.jobs)
    (worker,) = harness.workers
    worker.before_forward(step_after)
    kv_output = worker.after_forward(step_after)
    try:
        raise RuntimeError("One or more workers failed")
    except RuntimeError:  # vLLM's `fault_tolerant_wrapper` → `on_fault`
        harness.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    harness.wait_for_copies()
    harness.scheduler.update_from_output(  # as `EngineCoreSentinel._drain_batch_queue`
        SchedulerOutput.make_empty(), ModelRunnerOutput.with_kv_conn_output_only(kv_output)
    )
    drain(harness)
    assert num_tier_blocks(harness) == 4  # c's only: a's blocks hold c's KV
    assert not scheduler_side(harness).has_pending_stores()
    harness.add_request("d", list(range(7000, 7065)), max_tokens=2)
    drain(harness)
    assert num_tier_blocks(harness) == 8  # stores run again once the fault is known


def test_a_rank_that_skipped_a_plan_fails_the_stores_the_other_rank_runs() -> None:
    """Rank 0 raised before binding a's prefill plan; rank 1 ran the forward."""
    harness = kvtier_harness(num_ranks=2, **SCHEDULING["async_pipelined"])
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)  # c's KV is left in the GPU blocks the next request gets
    harness.add_request("a", PROMPT, max_tokens=4)
    failed_step = harness.scheduler.schedule()
    _, rank1 = harness.workers  # rank 0 never binds the failed step
    rank1.before_forward(failed_step)
    outputs = [rank1.after_forward(failed_step)]
    step_after = harness.scheduler.schedule()  # stores a's 4 blocks
    for worker in harness.workers:
        worker.before_forward(step_after)
        outputs.append(worker.after_forward(step_after))
    try:
        raise RuntimeError("One or more workers failed")
    except RuntimeError:  # vLLM's `fault_tolerant_wrapper` → `on_fault`
        harness.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    harness.wait_for_copies()
    for kv_output in outputs:
        harness.scheduler.update_from_output(
            SchedulerOutput.make_empty(), ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        )
    drain(harness)
    assert num_tier_blocks(harness) == 4  # c's only: a's blocks hold c's KV on rank 0
    harness.add_request("d", list(range(7000, 7065)), max_tokens=2)
    drain(harness)
    assert num_tier_blocks(harness) == 8
