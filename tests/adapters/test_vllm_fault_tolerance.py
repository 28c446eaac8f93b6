"""`KVTierConnector` under vLLM's fault tolerance (`enable_fault_tolerance`).

A forward that raises leaves its blocks unwritten, yet vLLM's model runner still calls
the connector's `start_load_kv` and `wait_for_save` (the `finally` of its KV connector
context), and its engine core then aborts every request from the exception handler of
its busy loop (`EngineCoreSentinel.on_fault`). vLLM counted the failed step's tokens as
computed when it scheduled them: kvtier must not store those blocks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, drain, kvtier_harness
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness

PROMPT = list(range(1000, 1065))  # 4 full blocks and a partial one


def raising_forward(harness: VllmHarness, scheduler_output: SchedulerOutput) -> None:
    """Raise from the forward, calling the worker roles as vLLM's model runner does."""
    try:
        raise RuntimeError("forward failed")  # nothing written into the KV cache
    finally:  # vLLM's `_get_kv_connector_output`
        for worker in harness.workers:
            worker.after_forward(scheduler_output)


def failed_forward(harness: VllmHarness) -> None:
    """Schedule a step whose forward raises."""
    scheduler_output = harness.scheduler.schedule()
    for worker in harness.workers:
        worker.before_forward(scheduler_output)
    with pytest.raises(RuntimeError, match="forward failed"):
        raising_forward(harness, scheduler_output)


def fault_abort(harness: VllmHarness) -> None:
    """Abort every request the way vLLM's engine core does after a failed step."""
    try:
        raise RuntimeError("One or more workers failed")
    except RuntimeError:  # vLLM's `fault_tolerant_wrapper` → `on_fault`
        harness.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_blocks_of_a_failed_forward_are_never_stored(num_ranks: int) -> None:
    harness = kvtier_harness(num_ranks=num_ranks)
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)  # c's KV is left in the GPU blocks the next request gets
    harness.add_request("a", PROMPT, max_tokens=4)
    failed_forward(harness)
    fault_abort(harness)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU cache only
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)
    drain(harness)  # KVMismatchError if a's unwritten blocks were stored and served
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
