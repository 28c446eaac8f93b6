"""Interrupts (Ctrl-C) while the engine takes a finished load's report from the worker
and applies it (`OffloadSide.poll`).

Regressions: `OffloadWorker.poll` let go of the lanes' reports before they reached the
engine, and `TransferCompletion.apply` forgot the completed events (`TransferBook.complete`)
before it applied them, so an interrupt in between lost the report or its effects; and
an interrupt after the scheduler applied a load but before `apply_report` returned lost
the finished load. Either way the lost load's GPU blocks (16 of the 19 here) stayed
pinned for good, or its request waited for it for good: the retried `generate` steps
forever (the watchdog stops it).

Now the worker keeps its reports until the engine applied them (`acknowledge`), an event
stays in the book until its effects are applied, and finished loads are kept until
`poll` returns them: whatever of this an interrupt cuts short, the next poll finishes,
applying each event once. Covered here: interrupts at those hand-offs, and at every line
of `TransferCompletion.apply` and `TransferBook.forget` (a step that releases pins is
counted before it runs, so an interrupt inside it leaks them rather than freeing them
twice: test_llm_completion_step_interrupts).
"""

from __future__ import annotations

import sys
from itertools import count
from types import CodeType, FrameType
from typing import Any

import pytest
from test_llm_submit_failures import (
    PARAMS,
    assert_consistent_and_drained,
    generate_all,
    new_engine,
    reference,
    turns,
)

from kvtier.engine.llm import LLM
from kvtier.engine.request import Request
from kvtier.offload.completion import TransferCompletion
from kvtier.offload.transfers import TransferBook
from kvtier.transfer.routes import Direction

MAX_CALLS = 10
# The turn run by `generate` (aborted when interrupted) or by `step` (its requests live on).
STEPPED = pytest.mark.parametrize("stepped", [False, True], ids=["generate", "step"])


def served_after_an_interrupt(
    llm: LLM,
    arm: Any,
    interrupted: list[bool],
    expected: list[Any] | None = None,
    stepped: bool = False,
) -> None:
    """Run the turn with tier hits until it succeeds, then check the engine drains, frees
    every GPU block and serves like an engine without offloading (`expected`: its
    tokens for the last two turns, computed here when None).

    `stepped`: run the turn by `add_request` and `step`, each interrupted step called
    again (`generate` aborts its requests when interrupted; the steps' requests live on).
    """
    first, second, third = turns()
    served = None
    for _ in range(MAX_CALLS):
        arm()
        try:
            served = run_turn(llm, second, stepped)
            break
        except KeyboardInterrupt:
            continue
    assert interrupted == [True], "the interrupt never landed"
    assert_consistent_and_drained(llm, arm)
    assert llm.offload is not None
    llm.offload.worker.check_invariants()
    arm()
    if expected is None:
        expected = reference([first, second, third])[1:]
    assert [served, *generate_all(llm, [third])] == expected
    llm.shutdown()


def run_turn(llm: LLM, prompts: list[list[int]], stepped: bool) -> list[Any]:
    """Return the tokens of `prompts`, run by `generate` or by `step` (see above)."""
    if not stepped:
        return [o.output_token_ids for o in llm.generate(prompts, PARAMS)]
    return [tuple(r.output_token_ids) for r in step_through(llm, prompts)]


def step_through(llm: LLM, prompts: list[list[int]]) -> list[Request]:
    """Run `prompts` by `add_request` and `step`, each interrupted step called again;
    return their requests."""
    requests = [llm.add_request(prompt, PARAMS) for prompt in prompts]
    while llm.scheduler.has_unfinished():
        try:
            llm.step()
        except KeyboardInterrupt:
            continue
    return requests


def loaded_engine() -> tuple[LLM, Any]:
    llm, arm = new_engine()
    first, _, _ = turns()
    llm.generate(first, PARAMS)
    llm.drain()
    return llm, arm


def interrupt_once(interrupted: list[bool], message: str) -> None:
    """Raise KeyboardInterrupt(message) unless one was raised already (`interrupted`)."""
    if not interrupted:
        interrupted.append(True)
        raise KeyboardInterrupt(message)


@STEPPED
def test_an_interrupt_after_the_load_lane_let_go_of_its_report(stepped: bool) -> None:
    llm, arm = loaded_engine()
    assert llm.offload is not None
    lane = llm.offload.worker._lanes[Direction.LOAD]
    finished = lane.finished  # the worker's peek, in the engine's poll
    interrupted: list[bool] = []

    def taking() -> Any:
        done, failed = finished()
        if done or failed:
            interrupt_once(interrupted, "Ctrl-C in OffloadWorker.peek")
        return done, failed

    lane.finished = taking  # type: ignore[method-assign]
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)


@STEPPED
def test_an_interrupt_after_the_book_completed_a_load(stepped: bool) -> None:
    llm, arm = loaded_engine()
    assert llm.offload is not None
    book = llm.offload.scheduler._book
    complete = book.complete
    interrupted: list[bool] = []

    def completing(report: Any) -> Any:
        completed = complete(report)
        if any(t.loads for t in completed):
            interrupt_once(interrupted, "Ctrl-C in TransferCompletion.apply")
        return completed

    book.complete = completing  # type: ignore[method-assign]
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)


@STEPPED
def test_an_interrupt_before_the_worker_let_go_of_an_applied_load(stepped: bool) -> None:
    # The report is applied, then the worker reports it again: ignored (not in flight);
    # the finished load is returned once, by the next poll.
    llm, arm = loaded_engine()
    assert llm.offload is not None
    worker = llm.offload.worker
    lane = worker._lanes[Direction.LOAD]
    acknowledge = worker.acknowledge
    interrupted: list[bool] = []

    def acknowledging() -> None:
        if lane.reported_event_ids():
            interrupt_once(interrupted, "Ctrl-C before OffloadWorker.acknowledge")
        acknowledge()

    worker.acknowledge = acknowledging  # type: ignore[method-assign]
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)


@STEPPED
@pytest.mark.parametrize("direction", list(Direction))
def test_an_interrupt_after_one_lane_let_go_of_an_applied_load(
    direction: Direction, stepped: bool
) -> None:
    # The other lane's reports, applied already, are reported again by the next poll.
    llm, arm = loaded_engine()
    assert llm.offload is not None
    lanes = llm.offload.worker._lanes
    lane = lanes[direction]
    acknowledge = lane.acknowledge
    interrupted: list[bool] = []

    def acknowledging() -> None:
        loaded = lanes[Direction.LOAD].reported_event_ids()
        acknowledge()
        if loaded:
            interrupt_once(interrupted, f"Ctrl-C after the {direction.value} lane's acknowledge")

    lane.acknowledge = acknowledging  # type: ignore[method-assign]
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)


@STEPPED
def test_an_interrupt_after_the_scheduler_applied_a_load(stepped: bool) -> None:
    # Regression: `apply_report` had taken the finished load from the completion; cut
    # short before it returned, the load was never returned, and its request (one run
    # by `step`, which outlives the interrupt) waited for it for good.
    llm, arm = loaded_engine()
    assert llm.offload is not None
    scheduler = llm.offload.scheduler
    completion, reset = scheduler._completion, scheduler._reset
    apply, note_report = completion.apply, reset.note_report
    outcomes: list[Any] = []
    interrupted: list[bool] = []

    def applying(report: Any) -> Any:
        outcomes.append(apply(report))
        return outcomes[-1]

    def noting() -> None:
        note_report()
        if outcomes[-1].finished_loads:
            interrupt_once(interrupted, "Ctrl-C before apply_report returned")

    completion.apply = applying  # type: ignore[method-assign]
    reset.note_report = noting  # type: ignore[method-assign]
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)


class LineInterrupt:
    """A tracer raising KeyboardInterrupt (once) at the `n`th line run in `codes` while
    `counting`: a Ctrl-C between any two of their lines."""

    def __init__(self, n: int, codes: tuple[CodeType, ...]) -> None:
        self.n, self.codes = n, codes
        self.counting = False
        self.landed: list[bool] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self.line if frame.f_code in self.codes else None

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "line" or not self.counting or self.landed:
            return self.line
        self.n -= 1
        if self.n == 0:
            sys.settrace(None)
            self.landed.append(True)
            raise KeyboardInterrupt(f"Ctrl-C at {frame.f_code.co_name}:{frame.f_lineno}")
        return self.line


def interrupted_at_every_line(codes: tuple[CodeType, ...], fewest_lines: int) -> None:
    """Serve the turn with a Ctrl-C at the 1st, 2nd, ... line run in `codes` while the
    engine applies a completed load (counted from `TransferBook.complete` returning a
    load to `TransferCompletion.apply` returning), until past their last line; more than
    `fewest_lines` lines must have run."""
    first, second, third = turns()
    expected = reference([first, second, third])[1:]
    for n in count(1):
        llm, arm = loaded_engine()
        assert llm.offload is not None
        scheduler = llm.offload.scheduler
        book, completion = scheduler._book, scheduler._completion
        complete, apply = book.complete, completion.apply
        tracer = LineInterrupt(n, codes)

        def completing(report: Any, complete: Any = complete, tracer: Any = tracer) -> Any:
            completed = complete(report)
            tracer.counting = tracer.counting or any(t.loads for t in completed)
            return completed

        def applying(report: Any, apply: Any = apply, tracer: Any = tracer) -> Any:
            outcome = apply(report)
            tracer.counting = False  # the loads are applied
            return outcome

        book.complete = completing  # type: ignore[method-assign]
        completion.apply = applying  # type: ignore[method-assign]
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            served_after_an_interrupt(llm, arm, tracer.landed, expected, stepped=True)
        except AssertionError as exc:
            if not tracer.landed and "never landed" in str(exc):  # past the last line
                assert n > fewest_lines, f"only {n - 1} lines ran"
                llm.shutdown()
                return
            raise AssertionError(f"interrupted at line {n}: {exc}") from exc
        finally:
            sys.settrace(previous)


def test_an_interrupt_at_any_line_of_applying_a_completed_load() -> None:
    codes = (TransferCompletion.apply.__code__, TransferBook.forget.__code__)
    interrupted_at_every_line(codes, fewest_lines=5)
