"""Which finishes a fault unconfirms (`SchedulerSide._finished_in_flight`), rule by rule
(mutation run s30, mutconn2).

A request that finishes while a plan it may count awaits its outputs is suspected until
those outputs come: a fault first makes kvtier take its finish as unconfirmed (its last
step's KV not stored). Suspecting too few serves KV a failed forward never wrote;
suspecting too many loses stores. Each test drives the scheduler role directly: plans
built from empty scheduler outputs, workers' outputs applied by step, finishes, and the
fault handler's abort (an abort while an exception is handled).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import kvtier_harness, scheduler_side
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvtier.adapters.vllm.metadata import KVTierWorkerMetadata
from kvtier.adapters.vllm.scheduler_side import SchedulerSide


@pytest.fixture
def overlapped() -> Iterator[Any]:
    harness = kvtier_harness(async_scheduling=True, batch_queue_size=2)
    yield harness
    harness.close()


def watched(harness: Any, monkeypatch: Any) -> tuple[SchedulerSide, list[str]]:
    """Return the scheduler role and the list of requests it unconfirms."""
    side = scheduler_side(harness)
    monkeypatch.setattr(side.offload, "on_finished", lambda view, ids, computed: False)
    unconfirmed: list[str] = []
    monkeypatch.setattr(
        side.offload, "unconfirm_finished", lambda view, tables: unconfirmed.append(view.request_id)
    )
    return side, unconfirmed


def plan(side: SchedulerSide) -> int:
    """Build the next step's plan; return its step id."""
    return side.build_metadata(SchedulerOutput.make_empty()).plan.step_id


def output_of(side: SchedulerSide, step: int) -> None:
    """Apply the (only) worker's output of `step`."""
    meta = KVTierWorkerMetadata(steps={0: step})
    side.apply_output(KVConnectorOutput(kv_connector_worker_meta=meta))


def finish(side: SchedulerSide, request_id: str) -> None:
    status = RequestStatus.FINISHED_STOPPED
    side.on_finished(SimpleNamespace(request_id=request_id, status=status), ([1],))


def fault(side: SchedulerSide) -> None:
    """Abort a request from the fault handler (an exception being handled)."""
    try:
        raise RuntimeError("a fault")
    except RuntimeError:
        status = RequestStatus.FINISHED_ABORTED
        side.on_finished(SimpleNamespace(request_id="victim", status=status), ([2],))


def test_a_finish_is_cleared_by_the_output_of_the_plan_it_awaited(
    overlapped: Any, monkeypatch: Any
) -> None:
    # `a` finished while plan 1 was in flight; plan 1's output came: no forward it counts
    # can fail any more, so the next fault leaves its store.
    side, unconfirmed = watched(overlapped, monkeypatch)
    step = plan(side)
    finish(side, "a")
    output_of(side, step)
    fault(side)
    assert unconfirmed == []


def test_a_fault_unconfirms_each_suspect_once(overlapped: Any, monkeypatch: Any) -> None:
    # By a later fault the blocks of `a` may hold another request's KV: unconfirming
    # them again would drop that request's stores.
    side, unconfirmed = watched(overlapped, monkeypatch)
    plan(side)
    finish(side, "a")
    fault(side)
    fault(side)
    assert unconfirmed == ["a"]


def test_a_suspect_older_than_the_horizon_is_dropped_but_not_a_recent_one(
    overlapped: Any, monkeypatch: Any
) -> None:
    # No output comes for 16 plans: the suspicion of `old` ends at the bound; `recent`,
    # which finished in the last plans, stays suspected.
    side, unconfirmed = watched(overlapped, monkeypatch)
    plan(side)
    finish(side, "old")
    for _ in range(15):
        plan(side)
    finish(side, "recent")
    plan(side)  # 17 plans: `old` (plan 1) is 16 behind
    fault(side)
    assert unconfirmed == ["recent"]


def test_without_overlapped_steps_no_finish_is_suspected() -> None:
    # One batch at a time: a request finishes only once every forward it counts reported
    # back, though the scheduler applies that output's connector part after it.
    harness = kvtier_harness(async_scheduling=False)
    try:
        assert harness.vllm_config.max_concurrent_batches == 1
        with pytest.MonkeyPatch.context() as monkeypatch:
            side, unconfirmed = watched(harness, monkeypatch)
            plan(side)
            finish(side, "a")
            fault(side)
            assert unconfirmed == []
    finally:
        harness.close()
