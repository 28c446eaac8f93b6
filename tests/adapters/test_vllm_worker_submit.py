"""The worker role when `OffloadWorker.submit` raises, and the plans it is handed.

As the reference engine's `OffloadSide.submit`, the worker role fails the events of a
refused plan the worker never started (`WorkerSide._fail_unsubmitted`): vLLM's fault
tolerance resumes the same connector after the error. The plans never carry manifest
work (`forget_slots`, `end_persistence`) that a refused plan could lose: the connector
refuses `disk_persist`; the last test pins that premise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from faulty_worker import FaultyWorker, job_kind
from kvtier_vllm import (
    SLOT_BYTES,
    check_quiescent,
    drain,
    kvtier_harness,
    kvtier_worker,
    offload_worker,
    zero_blocks,
)
from vllm.v1.request import RequestStatus

from kvtier.offload.plan import TransferPlan, WorkerReport
from kvtier.transfer.worker_config import WorkerState

PROMPT = list(range(1000, 1065))  # 4 full blocks


def record_reports(harness: Any) -> list[WorkerReport]:
    """Return the list the worker role's reports to the scheduler role will be added to."""
    side = kvtier_worker(harness).connector.worker_side  # type: ignore[attr-defined]
    take = side.take_worker_metadata
    reports: list[WorkerReport] = []

    def recording() -> Any:
        meta = take()
        if meta is not None:
            reports.append(meta.report)
        return meta

    side.take_worker_metadata = recording
    return reports


@pytest.mark.parametrize("refused", ["load", "store"])
def test_a_refused_plan_fails_its_events_and_leaks_nothing_once_vllm_resumes(
    refused: str,
) -> None:
    """vLLM's fault tolerance (`enable_fault_tolerance`) survives an exception out of
    `execute_model`: it aborts every request and resumes with the same connector.
    Regression: the events of the plan the worker refused were never reported, so
    their pins and the scheduler's pending stores stayed for good. They are now
    reported failed at the next step, the stores of a step whose loads were refused
    with them (vLLM skips `wait_for_save` then)."""
    harness = kvtier_harness()
    harness.add_request("a", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    worker = offload_worker(harness)
    submit = worker.submit

    def refusing(plan: TransferPlan) -> None:
        if any(job_kind(job) == refused for job in plan.jobs):
            worker.submit = submit  # type: ignore[method-assign]  # once
            raise OSError("injected: submit refused")
        submit(plan)

    worker.submit = refusing  # type: ignore[method-assign]
    reports = record_reports(harness)
    harness.add_request("c", list(range(5000, 5040)), max_tokens=4)  # 2 blocks to store
    harness.step()  # c computed: its stores go with the next plan, beside b's load
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)  # a tier hit: a load
    with pytest.raises(OSError, match="injected"):  # out of execute_model
        harness.step()  # b's load and c's stores in one plan
    harness.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)  # as vLLM's FT
    for _ in range(20):
        harness.step()
        if not harness.is_busy():
            break
    assert not harness.is_busy(), "stores still pending"
    harness.add_request("d", list(range(7000, 7020)), max_tokens=3)  # later steps' reports
    drain(harness)
    # Each refused event is reported failed once: a rank counting one twice would pass,
    # with several ranks, for two ranks done with it while another still copies.
    failures = [(e, n) for report in reports for e, n in report.failed.items()]
    assert failures
    assert sorted(failures) == sorted({e: 1 for e, _ in failures}.items())
    check_quiescent(harness)
    harness.close()
    assert worker.state is WorkerState.SHUT_DOWN


def test_the_connectors_plans_carry_no_manifest_work(tmp_path: Path) -> None:
    extra: dict[str, Any] = {"cpu_bytes": 0, "disk_bytes": 64 * SLOT_BYTES}
    extra |= {"disk_path": str(tmp_path), "disk_io_mode": "page_cache"}
    harness = kvtier_harness(extra=extra)
    worker = offload_worker(harness)
    faulty = FaultyWorker(worker, zero_blocks(harness))
    plans: list[TransferPlan] = []  # every plan the worker role hands over, whole

    def recording(plan: TransferPlan) -> None:
        plans.append(plan)
        faulty.submit(plan)

    worker.submit = recording  # type: ignore[method-assign]
    harness.add_request("a", PROMPT, max_tokens=2)
    faulty.fail["store"] = 1  # a failed disk store: dropped slots, were it persisting
    drain(harness)
    harness.add_request("b", [*PROMPT, 8], max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    faulty.fail_part = 1  # a load with a bad slot: its suspect slots dropped too
    harness.add_request("c", [*PROMPT, 9], max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)
    harness.add_request("d", [*PROMPT, 10], max_tokens=2)
    drain(harness)
    assert sum(faulty.num_failed.values()) >= 2
    assert plans
    assert all(plan.forget_slots == () and not plan.end_persistence for plan in plans)
    harness.close()


def test_a_plan_refused_after_its_jobs_started_reports_them_only_as_they_ran() -> None:
    """A submit that raises once the worker started the plan's jobs (an interrupt after
    the lanes took them): those jobs run and report as usual; failing them as well
    would report each event done and failed on one rank."""
    harness = kvtier_harness()
    harness.add_request("a", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    worker = offload_worker(harness)
    submit = worker.submit
    started: list[int] = []

    def raising_after(plan: TransferPlan) -> None:
        submit(plan)
        if any(job_kind(job) == "load" for job in plan.jobs):
            worker.submit = submit  # type: ignore[method-assign]  # once
            started.extend(job.event_id for job in plan.jobs)
            raise OSError("injected: raised after the jobs started")

    worker.submit = raising_after  # type: ignore[method-assign]
    reports = record_reports(harness)
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)  # a tier hit: a load
    with pytest.raises(OSError, match="injected"):  # out of execute_model
        harness.step()
    harness.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)  # as vLLM's FT
    for _ in range(20):
        harness.step()
        if not harness.is_busy():
            break
    assert started
    failed = {e for report in reports for e in report.failed}
    done = {e for report in reports for e in report.done}
    assert failed.isdisjoint(started), f"started events {started} reported failed"
    assert set(started) <= done
    check_quiescent(harness)
    harness.close()
