"""`KVTierConnector` under vLLM's fault tolerance with Model Runner V2 (0.33's default).

V2 (`vllm/v1/worker/gpu/kv_connector.py`, `ActiveKVConnector`) calls
`handle_preemptions` and `bind_connector_metadata` in `pre_forward`, and every later
connector call (`start_load_kv`, `wait_for_save`, the result calls) in `post_forward`,
which runs from `sample_tokens`, not from a `finally`: when the forward raises, the
connector hears nothing more of that plan until the next step binds its own. Its loads
must still be reported (failed), or vLLM holds the loading request's blocks for good; and
the failed forward must count as one, or a plan built before vLLM knew of the fault
stores blocks it never wrote (test_vllm_fault_tolerance.py: the same under V1).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees
from kvtier_vllm import SCHEDULING, check_quiescent, drain, kvtier_harness
from test_vllm_cascade import cascade_harness
from test_vllm_fault_tolerance import fault_abort
from vllm.v1.core.sched.output import SchedulerOutput
from vllm_harness import VllmHarness

PROMPT = list(range(5000, 5065))  # 4 full blocks and a partial one


def v2_failed_forward(harness: VllmHarness) -> SchedulerOutput:
    """Schedule a step whose forward raises, calling the worker roles as Model Runner V2
    does: `pre_forward`, then nothing."""
    scheduler_output = harness.scheduler.schedule()
    for worker in harness.workers:
        worker.before_forward(scheduler_output)
    return scheduler_output


def engine(name: str, tmp_path: Path) -> VllmHarness:
    if name == "write_back":  # a's load may come from either tier
        return cascade_harness(tmp_path, "write_back", num_cpu_blocks=7)
    if name == "lazy":
        return kvtier_harness(extra={"store_mode": "lazy"})
    return kvtier_harness(num_ranks=2 if name == "two_ranks" else 1)


@pytest.mark.parametrize("name", ["eager", "two_ranks", "lazy", "write_back"])
def test_a_load_of_a_plan_whose_forward_raised_is_reported(name: str, tmp_path: Path) -> None:
    harness = engine(name, tmp_path)
    harness.add_request("c", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    harness.add_request("a", [*PROMPT, 9], max_tokens=4)
    plan = v2_failed_forward(harness).kv_connector_metadata.plan  # loads c's 4 tier blocks
    assert any(job.is_load for job in plan.jobs)
    fault_abort(harness)  # vLLM keeps a's GPU blocks until its load is reported
    drain(harness, 300)
    check_quiescent(harness)
    # The failed load's tier copies are suspect and dropped; b recomputes, is stored,
    # and d is served from the tier again, byte for byte (`drain` checks the KV).
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)
    drain(harness, 300)
    harness.scheduler.reset_prefix_cache()
    harness.add_request("d", [*PROMPT, 8], max_tokens=2)
    drain(harness, 300)
    assert harness.external_hit_tokens("d") == 64
    check_quiescent(harness)


def test_stores_planned_before_the_fault_was_known_are_never_served() -> None:
    """Asynchronous scheduling: plan N+1 is built, and run by the worker, before the
    engine core learns that step N's forward raised; it stores a's prompt blocks, which
    only step N's forward was to write."""
    harness = kvtier_harness(**SCHEDULING["async"])
    harness.add_request("c", list(range(7000, 7065)), max_tokens=2)
    drain(harness)  # c's KV is left in the GPU blocks a gets next
    harness.add_request("a", PROMPT, max_tokens=50)
    v2_failed_forward(harness)  # a's prefill
    step_n1 = harness.scheduler.schedule()  # overlapped: a's first decode
    assert any(job.is_store for job in step_n1.kv_connector_metadata.plan.jobs)
    for worker in harness.workers:  # the worker runs N+1, already queued to it
        worker.before_forward(step_n1)
        worker.after_forward(step_n1)  # its output is dropped with the fault
    fault_abort(harness)
    drain_deferred_frees(harness)
    drain(harness, 300)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)
    drain(harness, 300)  # KVMismatchError if a's unwritten blocks were stored and served
    assert harness.external_hit_tokens("b") == 0
    check_quiescent(harness)
