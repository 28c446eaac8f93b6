"""A request aborted while its step N is in flight, before N's forward fails, when the
fault handler's abort is the scheduler role's only news of the failure.

As in test_vllm_abort_before_fault.py (overlapped steps: `a` aborted by a user after N
was scheduled, N+1 launched, then N's forward fails and vLLM's fault handler aborts the
requests left, `x` among them), but N+1's output never reaches the scheduler: vLLM drops
a step's whole output when a rank raises after its connector calls (redelivery.py), so
no worker report of the failure arrives before the next plans. The handler's abort of
`x` (`on_finished` inside an exception) must take `a`'s finish as unconfirmed
(`SchedulerSide._unconfirm_finishes`). Written by a mutation check: without that call
every test passed, the workers' later report of the failure covering it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees
from kvtier_vllm import SCHEDULING, drain, kvtier_harness
from test_vllm_abort_before_fault import check_no_local_hit_on_prompt
from test_vllm_fault_tolerance import PROMPT, fault_abort, launch, raising_forward
from vllm.v1.request import RequestStatus


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_the_fault_handlers_abort_unconfirms_a_finish_while_the_step_was_in_flight(
    store_mode: str,
) -> None:
    # Without it: KVMismatchError 'request b: position 0 (group 0, block 7, layer 0)
    # holds KV of another prefix' (vLLM served a's 4 unwritten blocks to b).
    harness = kvtier_harness(extra={"store_mode": store_mode}, **SCHEDULING["async_pipelined"])
    try:
        harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
        drain(harness)  # c's KV is left in the GPU blocks a gets
        harness.add_request("x", list(range(9000, 9020)), max_tokens=50)
        harness.add_request("a", PROMPT, max_tokens=4)
        step_n = launch(harness)  # a's 4 full blocks hashed, not yet written
        harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # no fault yet
        step_after = launch(harness)
        for worker in harness.workers:
            worker.after_forward(step_after)  # its output is dropped
        with pytest.raises(RuntimeError, match="forward failed"):
            raising_forward(harness, step_n)
        fault_abort(harness)  # x is still running: aborted inside the exception
        drain_deferred_frees(harness)  # the failed step is never processed
        harness.wait_for_copies()
        check_no_local_hit_on_prompt(harness)
    finally:
        harness.close()
