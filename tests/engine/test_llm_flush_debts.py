"""What the offload side still owes the worker after a flush or a submit went wrong.

A flush that failed is retried before the next plan, whether or not that plan needs one;
events the worker took before an interrupt in `submit` are sorted by the worker's own
report, never failed on top of it.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_llm_submit_failures import (
    ENGINE,
    PREEMPTING,
    assert_consistent_and_drained,
    generate_all,
    new_engine,
    prompts,
    recorded_plans,
    reference,
)

from kvtier.offload.plan import TransferPlan


def test_a_failed_flush_is_retried_before_a_plan_that_needs_none() -> None:
    """The flush before a preemption's plan fails; the next `prepare` flushes first,
    though its own plan (no preemption) asks for no flush."""
    llm, arm = new_engine(PREEMPTING)
    offload = llm.offload
    assert offload is not None
    built = recorded_plans(llm)
    flush = offload.worker.flush
    flushed_at: list[int] = []  # how many plans were built when a flush succeeded
    armed = [True]

    def flaky_flush() -> None:
        if armed[0] and built and built[-1].need_flush:
            armed[0] = False
            raise RuntimeError("injected flush failure")
        flush()
        flushed_at.append(len(built))

    offload.worker.flush = flaky_flush  # type: ignore[method-assign]
    calls = [prompts(4, 16), prompts(4, 16, offset=3)]
    with pytest.raises(RuntimeError, match="injected flush failure"):
        generate_all(llm, calls)
    failed_at = len(built)
    llm.step()  # nothing left to preempt: this step's plan needs no flush
    assert not built[-1].need_flush
    assert flushed_at[:1] == [failed_at + 1], "the failed flush was not retried first"
    assert_consistent_and_drained(llm, arm)
    llm.shutdown()


class InterruptedAfterSubmit:
    """Wrap a worker: the first plan with jobs is taken whole, then a Ctrl-C lands in
    `submit` before it returns."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.taken: TransferPlan | None = None

    def submit(self, plan: TransferPlan) -> None:
        self.worker.submit(plan)
        if self.taken is None and plan.jobs:
            self.taken = plan
            raise KeyboardInterrupt("Ctrl-C after the worker took the plan")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_events_the_worker_took_before_an_interrupt_are_not_failed() -> None:
    """Every event of the interrupted plan ran: its stores count done, none failed, and
    the next call hits the tier for the stored prefixes."""
    llm, arm = new_engine()
    assert llm.offload is not None
    worker = InterruptedAfterSubmit(llm.offload.worker)
    llm.offload.worker = worker  # type: ignore[assignment]
    first = prompts(4, 24)
    with pytest.raises(KeyboardInterrupt):
        generate_all(llm, [first])
    assert worker.taken is not None
    assert_consistent_and_drained(llm, arm)
    totals = llm.offload.totals
    assert (totals.num_failed_stores, totals.num_failed_loads) == (0, 0)
    assert totals.num_bytes_stored > 0
    again = [[*p, 1, 2] for p in first]
    arm()
    assert generate_all(llm, [again]) == reference([again], ENGINE)
    llm.shutdown()
