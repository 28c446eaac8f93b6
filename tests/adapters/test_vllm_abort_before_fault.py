"""A request aborted while its step is in flight, before that step's forward fails.

With overlapped steps (`async_scheduling`, a batch queue of 2) vLLM's engine core
schedules step N, processes its input queue (a user's abort of request `a`, scheduled in
N), schedules N+1, and only then waits for N's output: when N's forward raises, the fault
handler aborts every request left. `a`'s abort came before the exception, so kvtier is
told its compute is confirmed (`on_finished(computed=True)`), yet N never wrote its
blocks, which vLLM hashed when it scheduled them and freed with those hashes.

Before, kvtier dropped the hashes (`GpuPoolView.discard_keys_of`) and held back the
blocks of the requests the fault aborts only: vLLM served `a`'s blocks as local prefix
hits (its own defect, the canary below) and lazy mode's walk copied them into the tier,
whence kvtier served them as external hits. Now the scheduler role remembers the
requests that finish while a plan is in flight and, once a forward fails (its fault
handler's abort, or a worker's report of it), takes their finishes as unconfirmed
(`SchedulerSide._unconfirm_finishes`). Found by a fuzzing helper, reasoning about
`discard_keys_of`'s coverage (its harness cannot interleave an abort so).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees
from kvtier_vllm import SCHEDULING, check_quiescent, drain, kvtier_harness
from table_mirror import audit_tier
from test_vllm_fault_tolerance import (
    PROMPT,
    apply_output,
    failed_forward,
    fault_abort,
    launch,
    num_tier_blocks,
    raising_forward,
)
from vllm.v1.request import RequestStatus
from vllm_engine import HarnessConfig, KVMismatchError
from vllm_harness import VllmHarness


def abort_before_the_fault(harness: VllmHarness, live: bool = False) -> None:
    """Leave another prefix's KV in the GPU blocks; schedule `PROMPT`'s prefill (step N),
    abort it as a user would, launch N+1, then fail N's forward and abort the rest as
    vLLM's fault handler does (`live`: a request of another prompt is still running
    then; else none is, and the failure is learned from the workers' outputs); feed
    N+1's output and let the stores settle."""
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    if live:
        harness.add_request("x", list(range(9000, 9020)), max_tokens=50)
    harness.add_request("a", PROMPT, max_tokens=4)
    step_n = launch(harness)  # a's 4 full blocks hashed, not yet written
    harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # no fault yet
    step_after = launch(harness)
    (kv_output,) = [worker.after_forward(step_after) for worker in harness.workers]
    with pytest.raises(RuntimeError, match="forward failed"):
        raising_forward(harness, step_n)
    fault_abort(harness)
    drain_deferred_frees(harness)  # the failed step is never processed
    harness.wait_for_copies()
    apply_output(harness, kv_output)
    for _ in range(3):
        harness.step()
    harness.wait_for_copies()
    harness.step()


def check_no_local_hit_on_prompt(harness: VllmHarness) -> None:
    """Run `b`, whose prompt starts with `PROMPT`'s 4 full blocks, and check that vLLM
    serves it none of them (they were never written) and that all settles."""
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)
    drain(harness)
    assert harness.local_hit_tokens("b") == 0
    check_quiescent(harness)


@pytest.mark.parametrize("live", [False, True], ids=["learned_from_outputs", "fault_abort"])
def test_lazy_mode_stores_none_of_the_unwritten_blocks_of_a_request_aborted_before_the_fault(
    live: bool,
) -> None:
    # Regression: the lazy walk, run by the steps after the fault, copied a's 4 unwritten
    # blocks (c's KV) into the CPU tier under a's keys: 'assert 8 == 4', and the audit
    # failed with "CPU slot 5: position 0 ... holds KV of another prefix"; a request with
    # a's prompt then loaded them as a 64-token external hit.
    harness = kvtier_harness(extra={"store_mode": "lazy"}, **SCHEDULING["async_pipelined"])
    try:
        abort_before_the_fault(harness, live)
        assert num_tier_blocks(harness) == 4  # c's
        harness.add_request("d", list(range(7000, 7065)), max_tokens=2)
        drain(harness)
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) == 8  # c's and d's
        check_quiescent(harness)
    finally:
        harness.close()


@pytest.mark.parametrize("live", [False, True], ids=["learned_from_outputs", "fault_abort"])
@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_the_unwritten_blocks_of_a_request_aborted_before_the_fault_are_not_local_hits(
    store_mode: str, live: bool
) -> None:
    # vLLM's defect (the canary below), which kvtier mitigated for the requests the
    # fault aborts (test_vllm_failed_forward_hits.py), not for one aborted before. Was:
    # KVMismatchError 'request b: position 0 (group 0, block 5, layer 0) holds KV of
    # another prefix' (vLLM served a's 4 unwritten blocks to b as a 64-token local hit).
    harness = kvtier_harness(extra={"store_mode": store_mode}, **SCHEDULING["async_pipelined"])
    try:
        abort_before_the_fault(harness, live)
        check_no_local_hit_on_prompt(harness)
    finally:
        harness.close()


def test_vllm_serves_the_unwritten_blocks_of_a_request_aborted_before_the_fault() -> None:
    # vLLM's defect without kvtier (no connector). Should a later vLLM drop those hashes,
    # this fails: update docs/vllm.md ("Fault tolerance").
    harness = VllmHarness(HarnessConfig(**SCHEDULING["async_pipelined"]))
    try:
        abort_before_the_fault(harness)
        harness.add_request("b", [*PROMPT, 7], max_tokens=2)
        with pytest.raises(KVMismatchError, match="request b: position 0"):
            drain(harness)
    finally:
        harness.close()


@pytest.mark.parametrize("scheduling", ["sync", "async_pipelined"])
@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_a_finish_long_before_a_fault_keeps_its_blocks(store_mode: str, scheduling: str) -> None:
    # Without overlapped steps no plan is in flight when a request finishes (vLLM runs
    # each forward to its end first), so its finish is confirmed for good. Was: it was
    # remembered for 16 plans and taken as unconfirmed at the next fault: its blocks lost
    # their hashes ('assert 0 == 64'), and lazy mode never stored them.
    # With overlapped steps `a` finishes while a plan is in flight, so its finish is
    # suspected until the workers' output of that plan's step is applied. Was: every
    # output after it was empty (nothing to acknowledge) and did not advance
    # `processed_step`, so `a` stayed suspected for 16 plans and the fault long after its
    # steps all ran took its finish as unconfirmed ('assert 0 == 64' too).
    harness = kvtier_harness(extra={"store_mode": store_mode}, **SCHEDULING[scheduling])
    try:
        harness.add_request("a", PROMPT, max_tokens=2)
        drain(harness)
        harness.add_request("a2", [*PROMPT, 5], max_tokens=2)  # stores nothing new
        drain(harness)
        harness.add_request("x", list(range(9000, 9020)), max_tokens=50)
        failed_forward(harness)
        fault_abort(harness)
        drain(harness)
        harness.add_request("b", [*PROMPT, 7], max_tokens=2)
        drain(harness)
        assert harness.local_hit_tokens("b") == 64
        check_quiescent(harness)
    finally:
        harness.close()
