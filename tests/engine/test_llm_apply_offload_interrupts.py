"""Interrupts (Ctrl-C) between `OffloadSide.poll` returning a finished or failed load
and the engine's scheduler applying it (`Scheduler.apply_offload`), or inside that.

Regression: `poll` let go of the outcome as it returned it, so a Ctrl-C before or while
`apply_offload` used it lost the load: its request stayed in `scheduler.loading` for
good, and a turn run by `step` stepped forever (the watchdog stops it); cut short after
a failed load's request left `loading` but before it was queued again, the request was
dropped (never finished). Now `OffloadSide` keeps the outcome until the engine applied
it, the next step applies a kept one before it schedules anything, and `apply_offload`
ignores what is stale (a request not loading: finished, aborted or applied already).
"""

from __future__ import annotations

import sys
from itertools import count
from typing import Any

import pytest
from test_llm_poll_interrupts import (
    STEPPED,
    LineInterrupt,
    interrupt_once,
    loaded_engine,
    served_after_an_interrupt,
)
from test_llm_submit_failures import reference, turns

from kvtier.engine.llm import LLM
from kvtier.engine.load_failure import rewind
from kvtier.engine.offload_side import OffloadSide
from kvtier.engine.queue_recovery import QueueRecovery
from kvtier.engine.scheduler import Scheduler
from kvtier.offload.plan import TransferPlan, WorkerReport
from kvtier.offload.transfers import ReportOutcome

KINDS = pytest.mark.parametrize("kind", ["finished", "failed", "failed_naming"])


class FailFirstLoad:
    """Wrap a worker: its first load event is reported failed once the worker finished it,
    naming no bad block (every block suspect), or, `naming`, its last source block."""

    def __init__(self, worker: Any, naming: bool) -> None:
        self.worker = worker
        self.naming = naming
        self.event_id: int | None = None
        self.last_block = -1

    def submit(self, plan: TransferPlan) -> None:
        for job in plan.jobs:
            if self.event_id is None and job.is_load:
                self.event_id, self.last_block = job.event_id, job.src_block_ids[-1]
        self.worker.submit(plan)

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        event_id = self.event_id
        if event_id is None or event_id not in report.done:
            return report
        done = {e: n for e, n in report.done.items() if e != event_id}
        failed = {**report.failed, event_id: report.done[event_id]}
        bad = dict(report.bad_blocks)
        if self.naming:
            bad[event_id] = frozenset({self.last_block})
        return WorkerReport(done, failed, report.seconds, bad)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def engine_of_kind(kind: str) -> tuple[LLM, Any]:
    """Return a loaded engine whose next load finishes (`finished`) or fails."""
    llm, arm = loaded_engine()
    assert llm.offload is not None
    if kind != "finished":
        llm.offload.worker = FailFirstLoad(llm.offload.worker, kind == "failed_naming")
    return llm, arm


def has_kind(outcome: ReportOutcome, kind: str) -> bool:
    return bool(outcome.finished_loads if kind == "finished" else outcome.failed_loads)


def check_kind(llm: LLM, kind: str) -> None:
    """Check the load this test meant to apply was applied as it should be."""
    assert llm.offload is not None
    num_failed = llm.offload.totals.num_failed_loads
    assert num_failed == 0 if kind == "finished" else num_failed > 0


@STEPPED
@KINDS
def test_an_interrupt_between_poll_and_apply_offload(kind: str, stepped: bool) -> None:
    llm, arm = engine_of_kind(kind)
    scheduler = llm.scheduler
    apply = scheduler.apply_offload
    interrupted: list[bool] = []

    def applying(outcome: ReportOutcome) -> None:
        if has_kind(outcome, kind):
            interrupt_once(interrupted, "Ctrl-C before apply_offload")
        apply(outcome)

    scheduler.apply_offload = applying  # type: ignore[method-assign]
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)
    check_kind(llm, kind)


@STEPPED
@KINDS
def test_an_interrupt_after_apply_offload_applied_a_load(kind: str, stepped: bool) -> None:
    # The outcome is applied again, before the next step schedules: nothing twice.
    llm, arm = engine_of_kind(kind)
    scheduler = llm.scheduler
    apply = scheduler.apply_offload
    interrupted: list[bool] = []

    def applying(outcome: ReportOutcome) -> None:
        apply(outcome)
        assert len(set(map(id, scheduler.waiting))) == len(scheduler.waiting)
        if has_kind(outcome, kind):
            interrupt_once(interrupted, "Ctrl-C after apply_offload")

    scheduler.apply_offload = applying  # type: ignore[method-assign]
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)
    check_kind(llm, kind)


@STEPPED
def test_an_interrupt_right_after_a_failed_load_freed_its_blocks(stepped: bool) -> None:
    # The request recomputes from scratch: its blocks are freed, then a Ctrl-C. Applied
    # again, it frees none of them twice (`_free_blocks` takes the tables first).
    llm, arm = engine_of_kind("failed")
    scheduler, pool = llm.scheduler, llm.pool
    apply, free = scheduler.apply_offload, pool.free
    applying_failures: list[bool] = []
    interrupted: list[bool] = []

    def applying(outcome: ReportOutcome) -> None:
        applying_failures[:] = [bool(outcome.failed_loads)]
        try:
            apply(outcome)
        finally:
            applying_failures[:] = []

    def freeing(block_ids: Any) -> None:
        free(block_ids)
        if applying_failures == [True]:
            interrupt_once(interrupted, "Ctrl-C after a failed load's blocks were freed")

    scheduler.apply_offload = applying  # type: ignore[method-assign]
    pool.free = freeing  # type: ignore[method-assign]
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)
    check_kind(llm, "failed")


@KINDS
def test_an_interrupt_at_any_line_of_applying_an_outcome(kind: str) -> None:
    """A Ctrl-C at the 1st, 2nd, ... line run in the engine's code that applies the
    first outcome of `kind`, from `OffloadSide.poll` returning it to `outcome_applied`
    returning (traced only then), the turn run by `step`; until past the last line."""
    functions = (
        LLM._apply_offload,
        OffloadSide.unapplied_outcome,
        OffloadSide.outcome_applied,
        Scheduler.apply_offload,
        QueueRecovery._resume,
        rewind,
    )
    codes = tuple(f.__code__ for f in functions)
    first, second, third = turns()
    expected = reference([first, second, third])[1:]
    for n in count(1):
        llm, arm = engine_of_kind(kind)
        offload = llm.offload
        assert offload is not None
        tracer = LineInterrupt(n, codes)
        tracer.counting = True
        window: list[bool] = []  # opened once: the first outcome of `kind` is polled

        def polling(poll: Any = offload.poll, tracer: Any = tracer, window: Any = window) -> Any:
            outcome = poll()
            if not window and has_kind(outcome, kind):
                window.append(True)
                sys.settrace(tracer)
            return outcome

        def applied(outcome_applied: Any = offload.outcome_applied) -> None:
            outcome_applied()
            sys.settrace(None)

        offload.poll = polling  # type: ignore[method-assign]
        offload.outcome_applied = applied  # type: ignore[method-assign]
        try:
            served_after_an_interrupt(llm, arm, tracer.landed, expected, stepped=True)
        except AssertionError as exc:
            if not tracer.landed and "never landed" in str(exc):  # past the last line
                assert n > 8, f"only {n - 1} lines ran"
                llm.shutdown()
                return
            raise AssertionError(f"interrupted at line {n}: {exc}") from exc
        finally:
            sys.settrace(None)
        check_kind(llm, kind)
