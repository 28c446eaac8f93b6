"""A request aborted while its step is in flight, before that step's forward fails on
one rank of two (tensor parallel), overlapped steps.

Every worker output advances the scheduler role's `processed_step` by the step of the
plan its rank bound (`KVTierWorkerMetadata.step_id`), which ends the suspicion of the
finishes recorded while a plan was in flight. The healthy rank's output of the failed
step carries that step, yet the failure is reported by the failing rank only in its
next output: vLLM's multiproc executor salvages the healthy rank's output into the next
step's aggregate (`ft_defer_kv_connector_outputs`), so both arrive in one worker
metadata and the fault is seen with the step (`SchedulerSide.apply_output`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees, raise_from_forward
from kvtier_vllm import SCHEDULING, drain, kvtier_harness
from test_vllm_abort_before_fault import check_no_local_hit_on_prompt
from test_vllm_fault_tolerance import PROMPT, apply_output, fault_abort
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness


def abort_before_a_fault_on_one_rank(harness: VllmHarness, failing_rank: int, v2: bool) -> None:
    """Schedule `PROMPT`'s prefill (step N); its forward runs on every rank, raising on
    `failing_rank` (the other's output salvaged); abort it as a user would, run N+1 on
    every rank (vLLM's ranks finish N's calls before binding N+1), then learn of the
    failure as vLLM does (no request left: from N+1's aggregated output)."""
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    harness.add_request("a", PROMPT, max_tokens=4)
    step_n = harness.scheduler.schedule()
    for worker in harness.workers:
        worker.before_forward(step_n)
    salvaged = []
    for rank, worker in enumerate(harness.workers):
        if rank == failing_rank:
            raise_from_forward(worker, step_n, v2)
        else:
            salvaged.append(worker.after_forward(step_n))
    harness._aggregator.ft_defer_kv_connector_outputs(salvaged)
    harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # no fault yet
    step_after = harness.scheduler.schedule()
    for worker in harness.workers:
        worker.before_forward(step_after)
    outputs = [
        ModelRunnerOutput([], {}, kv_connector_output=worker.after_forward(step_after))
        for worker in harness.workers
    ]
    aggregated = harness._aggregator.aggregate(outputs)
    assert aggregated is not None
    fault_abort(harness)  # N's failure raised in the engine core: nothing left to abort
    drain_deferred_frees(harness)
    harness.wait_for_copies()
    apply_output(harness, aggregated.kv_connector_output)  # the batch queue's drain
    for _ in range(3):
        harness.step()
    harness.wait_for_copies()
    harness.step()


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("failing_rank", [0, 1])
@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_a_healthy_rank_s_output_of_the_failed_step_does_not_confirm_an_abort(
    store_mode: str, failing_rank: int, v2: bool
) -> None:
    harness = kvtier_harness(
        num_ranks=2, extra={"store_mode": store_mode}, **SCHEDULING["async_pipelined"]
    )
    try:
        abort_before_a_fault_on_one_rank(harness, failing_rank, v2)
        check_no_local_hit_on_prompt(harness)
    finally:
        harness.close()
