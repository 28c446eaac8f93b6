"""A request aborted while its step is in flight, before that step's forward fails on
one rank of two, delivered as vLLM 0.33's multiproc executor delivers it with Model
Runner V1 and a batch queue (a pipeline's stages, or asynchronous scheduling).

Both runners return a forward's connector output from `sample_tokens`, not from
`execute_model` (V1 `GPUModelRunner.execute_model` returns None once the forward ran and
keeps the output for `sample_tokens`), so when a rank's `execute_model` raises the other
ranks' `execute_model` replies are None and the executor salvages nothing
(`MultiprocExecutor.collective_rpc`: `ft_defer_kv_connector_outputs` only takes replies
that carry a connector output). With a batch queue the engine core has already sent the
step's `sample_tokens`: the healthy rank answers with its output of the failed step, the
failing rank (V1: no `execute_model_state`) with an empty output, and all replies are
successes, so `KVOutputAggregator.aggregate` merges the healthy rank's output alone and
the engine core applies it to the failed step (`step_with_batch_queue` only looks at the
`execute_model` future when the aggregate is None). With every request of that step
finished (the user's abort) `update_from_output` goes through: kvtier gets the healthy
rank's output of step N, the failing rank's report of the failure only with N+1's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import raise_from_forward, rank_reply
from kvtier_vllm import SCHEDULING, drain, kvtier_harness
from test_vllm_abort_before_fault import check_no_local_hit_on_prompt
from test_vllm_fault_tolerance import PROMPT, launch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness

from kvtier.adapters.vllm.metadata import KVTierWorkerMetadata
from kvtier.adapters.vllm.redelivery import Receipts


def v1_sample_outputs(
    harness: VllmHarness, step: SchedulerOutput, failing_rank: int | None
) -> list[ModelRunnerOutput]:
    """Each rank's `sample_tokens` reply for `step` (their connector output only), the
    forward having raised on `failing_rank` (V1's `finally` ran its connector calls, the
    output dropped with the exception) and run on the others."""
    replies = []
    for rank, worker in enumerate(harness.workers):
        if rank == failing_rank:
            raise_from_forward(worker, step, v2=False)
            replies.append(rank_reply())  # no `execute_model_state`
        else:
            kv_output = worker.after_forward(step)
            replies.append(rank_reply(kv_output))
    return replies


def abort_before_a_fault_on_one_rank_v1(
    harness: VllmHarness, failing_rank: int, output_rank: int
) -> None:
    """Schedule `PROMPT`'s prefill (step N), abort it as a user would (the engine core's
    input queue, before N+1 is scheduled), schedule N+1 (the abort's empty step); N's
    forward raises on `failing_rank`; the engine core applies N's `sample_tokens`
    aggregate (`output_rank`'s reply), then N+1's, and goes on."""
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    harness.add_request("a", PROMPT, max_tokens=4)
    step_n = launch(harness)
    replies_n = v1_sample_outputs(harness, step_n, failing_rank)  # the ranks run N first
    harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # no fault yet
    step_after = launch(harness)
    replies_after = [rank_reply(worker.after_forward(step_after)) for worker in harness.workers]
    for step, replies in ((step_n, replies_n), (step_after, replies_after)):
        aggregated = harness._aggregator.aggregate(replies, output_rank=output_rank)
        assert aggregated is not None
        harness.scheduler.update_from_output(step, aggregated)  # no KeyError: `a` finished
    for _ in range(3):
        harness.step()
    harness.wait_for_copies()
    harness.step()


def test_one_worker_s_applied_step_is_not_every_worker_s() -> None:
    # Was: `processed_step` took the newest step of any worker (a max over ranks).
    receipts = Receipts(num_workers=2)
    receipts.note_steps({7: 5})
    assert receipts.processed_step == 0  # worker 8's output of step 5 never came
    receipts.note_steps({8: 6, 7: 6})
    assert receipts.processed_step == 6
    receipts.note({7: (8, (1,))})  # an output to acknowledge carries its step too
    assert receipts.processed_step == 6
    receipts.note_steps({8: 7})
    assert receipts.processed_step == 7


def test_aggregated_metadata_keeps_each_worker_s_later_step() -> None:
    a, b, a_later = (KVTierWorkerMetadata(steps=s) for s in ({1: 5}, {2: 4}, {1: 6}))
    assert a.aggregate(b).steps == {1: 5, 2: 4}
    assert a.aggregate(b).aggregate(a_later).steps == {1: 6, 2: 4}  # salvaged with the next
    assert a_later.aggregate(a).step_id == 6
    assert a.aggregate(b).step_id == 5  # the newest step any worker had bound
    assert KVTierWorkerMetadata().step_id == 0


@pytest.mark.parametrize(
    ("failing_rank", "output_rank"),
    [(1, 1), (1, 0)],
    ids=["last_stage", "tensor_parallel"],
)
@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_a_healthy_rank_s_output_of_the_failed_step_alone_does_not_confirm_an_abort(
    store_mode: str, failing_rank: int, output_rank: int
) -> None:
    # Was: KVMismatchError 'request b: position 0 (group 0, block 5, layer 0) holds KV of
    # another prefix': the healthy rank's output of N alone advanced `processed_step` to
    # N, confirming `a`'s finish, so the failing rank's report (N+1's output) found no
    # finish to take as unconfirmed, and vLLM served a's 4 unwritten blocks to b.
    harness = kvtier_harness(
        num_ranks=2, extra={"store_mode": store_mode}, **SCHEDULING["async_pipelined"]
    )
    try:
        abort_before_a_fault_on_one_rank_v1(harness, failing_rank, output_rank)
        check_no_local_hit_on_prompt(harness)
    finally:
        harness.close()
