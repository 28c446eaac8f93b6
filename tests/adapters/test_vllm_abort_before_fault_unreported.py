"""A request aborted while its step is in flight, with no other step in flight and no
request left, before that step's forward fails: a window kvtier does not cover (yet).

vLLM's engine core (overlapped steps) schedules step N (request `a`'s prefill), takes a
user's abort of `a` and, with nothing left to schedule, waits for N: its forward raises,
and the fault handler has no request to abort. kvtier learns of the failure only from
the workers' next output, which comes after the next step was scheduled: vLLM serves
that step's request `a`'s unwritten blocks as local prefix hits (vLLM's defect: the
canary `test_vllm_abort_before_fault.py::test_vllm_serves_the_unwritten_blocks_...`),
since kvtier has not yet dropped their hashes (`SchedulerSide._unconfirm_finishes`).
The tier stays clean: the plan of that step is built before the failure was learned,
so the workers fail its stores. Found by a fuzzing helper (its pipelined-fault op).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees
from kvtier_vllm import SCHEDULING, kvtier_harness
from test_vllm_abort_before_fault import check_no_local_hit_on_prompt
from test_vllm_fault_tolerance import PROMPT, fault_abort, launch, raising_forward
from vllm.v1.request import RequestStatus
from vllm_engine import KVMismatchError


@pytest.mark.xfail(
    raises=KVMismatchError,
    strict=True,
    reason="no connector call tells kvtier of the fault before the next step is scheduled",
)
def test_an_abort_before_an_unreported_fault_leaves_no_local_hit() -> None:
    # Fails with KVMismatchError 'request b: position 0 (group 0, block 5, layer 0)
    # holds KV of another prefix' (a 64-token local hit on a's unwritten blocks).
    harness = kvtier_harness(extra={"store_mode": "eager"}, **SCHEDULING["async_pipelined"])
    try:
        harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
        harness.run()
        harness.add_request("a", PROMPT, max_tokens=4)
        step_n = launch(harness)  # a's 4 full blocks hashed, not yet written
        harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # no fault yet
        with pytest.raises(RuntimeError, match="forward failed"):
            raising_forward(harness, step_n)
        fault_abort(harness)  # nothing left to abort: kvtier is told nothing
        drain_deferred_frees(harness)  # the failed step is never processed
        harness.wait_for_copies()
        check_no_local_hit_on_prompt(harness)
    finally:
        harness.close()
