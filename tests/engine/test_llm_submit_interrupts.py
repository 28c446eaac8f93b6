"""Interrupts (Ctrl-C) while the engine hands a step's plan to the worker, or sorts out
a plan the worker refused.

Whatever call the interrupts hit, and however many land, the events the worker never
took are failed (a refused plan's once a flush succeeds): none stays in flight, pinning
its GPU blocks for good.
"""

from __future__ import annotations

import sys
from itertools import count
from types import FrameType
from typing import Any

import pytest
from test_llm_submit_failures import (
    PARAMS,
    RefusingWorker,
    assert_consistent_and_drained,
    has_stores,
    new_engine,
    prompts,
    serve_the_whole_pool,
)

import kvtier.engine.offload_side as offload_side
from kvtier.engine.llm import LLM
from kvtier.offload.plan import TransferPlan

MAX_CALLS = 10  # generate calls: each interrupt fails one; a hang fails the test


class InterruptingWorker(RefusingWorker):
    """Refuse the first plan with stores (`error`), then raise KeyboardInterrupt in the
    flushes and polls numbered in `interrupted` (1: the first one after the refusal)."""

    def __init__(self, worker: Any, error: BaseException, interrupted: tuple[int, ...]) -> None:
        super().__init__(worker, has_stores, error)
        self.interrupted = interrupted
        self.num_calls = 0

    def _count(self, name: str) -> None:
        if self.refused is None:
            return
        self.num_calls += 1
        if self.num_calls in self.interrupted:
            raise KeyboardInterrupt(f"Ctrl-C in {name} {self.num_calls}")

    def flush(self) -> None:
        self._count("flush")
        self.worker.flush()

    def peek(self) -> Any:
        self._count("peek")
        return self.worker.peek()


# Calls after the refusal: 1 is the flush in `submit`'s handler; if that one succeeds,
# 2 is the poll that sorts the events; if not, 2 and 3 are the flush and poll retried
# before the next plan (a flush that fails is retried before the plan after).
INTERRUPTED_CALLS = [(1,), (2,), (3,), (1, 2), (1, 3), (2, 3), (1, 2, 3), (2, 3, 4)]


@pytest.mark.parametrize(
    ("error", "interrupted"),
    [
        *((ValueError("rejected job"), calls) for calls in INTERRUPTED_CALLS),
        (KeyboardInterrupt("Ctrl-C in submit"), (2,)),
        (KeyboardInterrupt("Ctrl-C in submit"), (1, 2, 3)),
    ],
    ids=repr,
)
def test_interrupts_while_a_refused_plan_is_sorted_never_strand_it(
    error: BaseException, interrupted: tuple[int, ...]
) -> None:
    # Regression: the events were recorded as owed only once the flush in the handler
    # had failed; a Ctrl-C in the poll after a flush that succeeded (2 without 1) left
    # them in flight for good: their stores pinned GPU blocks, so a request needing the
    # whole pool never fit and `generate` stepped forever.
    llm, arm = new_engine()
    assert llm.offload is not None
    worker = InterruptingWorker(llm.offload.worker, error, interrupted)
    llm.offload.worker = worker
    for offset in count(step=10):
        assert offset < 10 * MAX_CALLS, "generate kept failing"
        arm()
        try:
            llm.generate(prompts(2, 24, offset), PARAMS)
        except (KeyboardInterrupt, ValueError):
            continue
        if worker.num_calls >= max(interrupted):
            break
    assert worker.refused is not None
    serve_the_whole_pool(llm, arm)


def test_a_plan_interrupted_before_its_submit_is_failed_by_the_next_prepare() -> None:
    # Regression: a Ctrl-C between `prepare` and `submit` (say as `submit` starts) left
    # the plan unsubmitted, and the next `prepare` replaced it: its events were never
    # reported (the stores' GPU blocks pinned for good, `generate` stepped forever).
    llm, arm = new_engine()
    offload = llm.offload
    assert offload is not None
    build_plan, submit = offload.scheduler.build_plan, offload.submit
    built: list[TransferPlan] = []

    def building(step: Any) -> TransferPlan:
        plan = build_plan(step)
        if not built and has_stores(plan):
            built.append(plan)
        return plan

    def interrupted_submit() -> None:
        if len(built) == 1:
            built.append(built[0])  # once
            raise KeyboardInterrupt("Ctrl-C as submit starts")
        submit()

    offload.scheduler.build_plan = building  # type: ignore[method-assign]
    offload.submit = interrupted_submit  # type: ignore[method-assign]
    arm()
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C as submit starts"):
        llm.generate(prompts(2, 24), PARAMS)
    serve_the_whole_pool(llm, arm)


class LineInterrupt:
    """A tracer raising KeyboardInterrupt at the `n`th line that runs in `offload_side.py`
    while `counting` (once; it then stops tracing): a Ctrl-C between any two lines."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.counting = False
        self.landed: str | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != offload_side.__file__:
            return None
        return self.line

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "line" or not self.counting:
            return self.line
        self.n -= 1
        if self.n == 0:
            sys.settrace(None)
            self.counting = False
            self.landed = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise KeyboardInterrupt(f"Ctrl-C at {self.landed}")
        return self.line


class FlushingWorker:
    """Wrap a worker: each poll waits for every transfer submitted first (so reports it)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def peek(self) -> Any:
        self.worker.flush()
        return self.worker.peek()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def interrupt_the_hand_off_at(llm: LLM, n: int, refused: bool) -> str | None:
    """Interrupt the `n`th line run in the engine's `OffloadSide` from the build of the
    first plan with stores until its refusal propagates (`refused`: the worker refuses
    it) or the poll that reports it applied its reports; return where it landed (None:
    fewer lines ran). Runs calls until one succeeded."""
    offload = llm.offload
    assert offload is not None
    if refused:
        offload.worker = RefusingWorker(offload.worker, has_stores, ValueError("rejected"))
    else:
        offload.worker = FlushingWorker(offload.worker)
    tracer = LineInterrupt(n)
    build_plan, submit = offload.scheduler.build_plan, offload.submit
    take_stats = offload.scheduler.take_stats
    built: list[TransferPlan] = []

    def building(step: Any) -> TransferPlan:
        plan = build_plan(step)
        if not built and has_stores(plan):
            built.append(plan)
            tracer.counting = True
        return plan

    def submitting() -> None:
        try:
            submit()
        except BaseException:
            tracer.counting = False
            raise

    def taking_stats() -> Any:
        tracer.counting = False  # the poll applied its reports and let go of them
        return take_stats()

    offload.scheduler.build_plan = building  # type: ignore[method-assign]
    offload.submit = submitting  # type: ignore[method-assign]
    offload.scheduler.take_stats = taking_stats  # type: ignore[method-assign]
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for offset in range(0, 10 * MAX_CALLS, 10):
            try:
                llm.generate(prompts(2, 24, offset), PARAMS)
            except (KeyboardInterrupt, ValueError):
                continue
            assert built, "no plan with stores"
            return tracer.landed
    finally:
        sys.settrace(previous)
    raise AssertionError("generate kept failing")


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "taken"])
def test_an_interrupt_at_any_line_of_the_hand_off_never_strands_the_plan(refused: bool) -> None:
    # Regression: a refused plan's events were owed a flush only once the handler had
    # recorded them, and a plan was recorded only at the end of `prepare`: an interrupt
    # before either left events in flight for good (the worker-call injections above
    # cannot land there). Likewise `poll` let go of the worker's reports before applying
    # them.
    landed = []
    for n in count(1):
        llm, arm = new_engine()
        arm()
        where = interrupt_the_hand_off_at(llm, n, refused)
        if where is None:
            llm.shutdown()
            break
        landed.append(where)
        try:
            assert_consistent_and_drained(llm, arm)
        except (AssertionError, RuntimeError) as exc:
            raise AssertionError(f"interrupted at {where}: {exc}") from exc
        llm.shutdown()
    assert any(w.startswith("submit") for w in landed), landed
    if refused:
        assert any(w.startswith("_fail_unconfirmed") for w in landed), landed
    else:
        assert any(w.startswith("poll") for w in landed), landed
