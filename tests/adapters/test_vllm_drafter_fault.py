"""A speculative decoding drafter that raises under vLLM's fault tolerance.

With a speculative config vLLM 0.33's model runners (V1's `sample_tokens`, V2's
`sample_tokens`) collect the connector's results after the target model's forward
(`get_transfer_results`, `build_connector_worker_meta`) but defer `wait_for_save` and
`clear_connector_metadata` until the drafter ran: its forward writes the draft layers'
KV of the step's positions. A drafter that raises skips both, and vLLM drops the step's
output. Under overlapped scheduling the next plan, built before the fault was known,
stores the step's blocks: their target-model KV is written, their draft KV is not.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import SCHEDULING, drain, kvtier_harness
from test_vllm_fault_tolerance import (
    PROMPT,
    check_stores_resume,
    num_tier_blocks,
    settle_after_fault,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm_harness import VllmHarness


class DrafterError(RuntimeError):
    """The drafter's exception."""


def step_whose_drafter_raises(harness: VllmHarness) -> SchedulerOutput:
    """Schedule a step whose target forward writes its KV and whose drafter raises,
    calling the worker roles as vLLM's model runner does with a speculative config."""
    scheduler_output = harness.scheduler.schedule()
    for worker in harness.workers:
        worker.before_forward(scheduler_output)
    harness._forward(scheduler_output)  # the target model's KV is written
    for worker in harness.workers:  # `post_forward(defer_finalize=True)`
        connector = worker.connector
        connector.start_load_kv(None)  # type: ignore[arg-type]
        connector.get_transfer_results(scheduler_output.finished_req_ids)
        connector.build_connector_worker_meta()
    with pytest.raises(DrafterError):  # no `wait_for_save`, no `clear_connector_metadata`
        raise DrafterError("drafter failed")
    return scheduler_output


def test_stores_planned_before_a_drafter_fault_was_known_are_failed() -> None:
    """Regression: the step after the one whose drafter raised, planned before the fault
    was known, stored a's 4 blocks (8 tier blocks, not 4): the worker failed the raising
    step's own stores but did not count it as a failed forward."""
    harness = kvtier_harness(**SCHEDULING["async_pipelined"])
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    assert num_tier_blocks(harness) == 4
    harness.add_request("a", PROMPT, max_tokens=4)
    step_whose_drafter_raises(harness)
    step_after = harness.scheduler.schedule()  # its plan stores a's 4 blocks
    assert any(job.is_store for job in step_after.kv_connector_metadata.plan.jobs)
    (worker,) = harness.workers
    worker.before_forward(step_after)
    harness._forward(step_after)
    kv_output = worker.after_forward(step_after)
    settle_after_fault(harness, kv_output)
    assert num_tier_blocks(harness) == 4  # c's only: a's draft KV was never written
    check_stores_resume(harness)  # once the fault is known
