"""A request aborted with two steps in flight, its eager stores still queued when a
later step's output reports the failure (a pipeline of 3 stages).

vLLM's engine core (batch queue of 3) schedules step N (the first chunk of request `a`'s
prefill) and N+1 (its second chunk), takes a user's abort of `a` between two steps, then,
with no request left, schedules nothing: it waits for N, whose forward raised, and its
fault handler feeds N+1's connector output, which reports N's failure, to the scheduler
(`EngineCoreSentinel._drain_batch_queue`). The abort's eager stores of `a`'s confirmed
blocks (N+1's chunk counted) were selected after the last plan was built: no plan the
workers fail carries them, they ride in the first plan built after the failure was
learned. Found reviewing the lost-key registration (`Registrar.register`): the blocks
had lost their keys to the unconfirmed finish, and the stores registered the keys
selected.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees
from kvtier_vllm import check_quiescent, drain, kvtier_harness, scheduler_side
from table_mirror import audit_tier
from test_vllm_fault_tolerance import apply_output, fault_abort, launch, raising_forward
from vllm.v1.request import RequestStatus

from kvtier.core.keys import make_key


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_stores_an_abort_queued_before_a_fault_learned_later_are_dropped(
    store_mode: str,
) -> None:
    # Regression (eager): the queued stores copied a's blocks 2 and 3, never written
    # (c's KV), and registered them under a's keys: the tier audit failed with
    # KVMismatchError 'CPU slot 11: position 32 (group 0, block 11, layer 0) holds KV of
    # another prefix'.
    harness = kvtier_harness(
        extra={"store_mode": store_mode},
        async_scheduling=True,
        batch_queue_size=3,
        max_num_batched_tokens=32,  # two blocks a step
    )
    try:
        harness.add_request("c", list(range(5000, 5129)), max_tokens=2)
        drain(harness)  # c's 8 blocks stored; their KV stays in the GPU blocks
        harness.add_request("a", list(range(1000, 1129)), max_tokens=4)
        step_n = launch(harness)  # a's blocks 0 and 1
        step_after = launch(harness)  # a's blocks 2 and 3 (N+1)
        harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # no fault yet
        if store_mode == "eager":  # blocks 0 and 1 went with N+1's plan, which fails
            assert len(scheduler_side(harness).offload.selector.queued) == 2
        with pytest.raises(RuntimeError, match="forward failed"):
            raising_forward(harness, step_n)
        (kv_output,) = [worker.after_forward(step_after) for worker in harness.workers]
        fault_abort(harness)  # nothing left to abort
        drain_deferred_frees(harness)  # the failed step is never processed
        harness.wait_for_copies()
        apply_output(harness, kv_output)  # reports N's failure
        harness.add_request("d", list(range(7000, 7065)), max_tokens=2)
        drain(harness)
        assert harness.scheduler.reset_prefix_cache()
        num_audited = audit_tier(harness)  # every slot holds its key's KV
        index = scheduler_side(harness).offload.tier_pool.index
        request = harness.requests["a"]
        assert not [h for h in request.block_hashes if make_key(h, 0) in index]
        if store_mode == "eager":
            assert num_audited == 12  # c's and d's
        check_quiescent(harness)
    finally:
        harness.close()
