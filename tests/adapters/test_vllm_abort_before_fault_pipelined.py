"""A request aborted while its step is in flight, with an earlier step also in flight
(a pipeline of 3 stages: vLLM's batch queue holds 3 steps), before its step's forward
fails.

vLLM's engine core schedules step N (request `a`'s prefill) with N-2 and N-1 still in
flight, processes N-2's output, takes a user's abort of `a`, schedules N+1, processes
N-1's output (its forward ran), then learns that N's forward failed. The scheduler role
remembers `a` as finished while N was in flight (`SchedulerSide._finished_in_flight`):
N-1's output confirms only the plans up to N-1, so `a` must stay suspected until N's
own output. Written by a mutation check: forgetting the finishes of one plan past the
processed one (N's, at N-1's output) went unnoticed by every test (a's unwritten blocks
then kept their hashes, and vLLM served them to `b` as a local prefix hit).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees
from kvtier_vllm import drain, kvtier_harness
from test_vllm_abort_before_fault import check_no_local_hit_on_prompt
from test_vllm_fault_tolerance import PROMPT, apply_output, fault_abort, launch, raising_forward
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness


def abort_with_an_earlier_step_in_flight(harness: VllmHarness) -> None:
    """Leave another prefix's KV in the GPU blocks; run `x`'s steps up to N-1 (N-1's
    output acknowledges N-2's store: an output with nothing to acknowledge confirms no
    plan), launch N (`a`'s prefill), abort `a`, feed N-1's output, fail N's forward and
    abort the rest as vLLM's fault handler does; let the stores settle."""
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    harness.add_request("x", list(range(9000, 9020)), max_tokens=50)
    outputs = []
    for _ in range(3):  # x's prefill; its decode, storing its block 0; its next decode
        step = launch(harness)
        outputs += [worker.after_forward(step) for worker in harness.workers]
        harness.wait_for_copies()
    for output in outputs[:2]:
        apply_output(harness, output)
    harness.add_request("a", PROMPT, max_tokens=4)
    step_n = launch(harness)  # a's 4 full blocks hashed, not yet written
    harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # no fault yet
    apply_output(harness, outputs[2])  # N-1's forward ran: confirms plans up to N-1 only
    with pytest.raises(RuntimeError, match="forward failed"):
        raising_forward(harness, step_n)
    fault_abort(harness)  # x is still running: the fault handler aborts it
    drain_deferred_frees(harness)  # the failed step is never processed
    harness.wait_for_copies()
    for _ in range(3):
        harness.step()
    harness.wait_for_copies()
    harness.step()


def test_a_finish_stays_suspected_until_its_own_steps_output() -> None:
    # With the finishes of N forgotten at N-1's output: KVMismatchError 'request b:
    # position 0 (group 0, block 7, layer 0) holds KV of another prefix' (vLLM served
    # a's 4 unwritten blocks to b as a 64-token local hit).
    harness = kvtier_harness(
        extra={"store_mode": "eager"}, async_scheduling=True, batch_queue_size=3
    )
    try:
        abort_with_an_earlier_step_in_flight(harness)
        check_no_local_hit_on_prompt(harness)
    finally:
        harness.close()
