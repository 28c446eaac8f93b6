"""Interrupts (Ctrl-C) while `Scheduler._admit` hands a request with a tier hit its load.

Regression: `_admit` called `on_allocated` (which queues the load) before it marked the
request WAITING_FOR_LOAD; a Ctrl-C in between left it in `waiting` with its hit counted
as computed, and the next admission ran it as one back from its load while the load was
still pending: it attended to KV not written yet (logits off by about 0.1, tokens the
same in this small model). Marking it first alone would hang a request whose load an
interrupt kept from being queued. Now it is marked loading first, and `_settle` rewinds
one whose load the offload side does not hold (it recomputes); the load is queued whole.

Regression too: a Ctrl-C while `_admit` touched the request's hit blocks or allocated its
new ones, before the request took its tables, leaked them (the drained engine's pool
short of free blocks). Now the request takes each block in the statement that takes it
from the pool, and `_settle` frees them (waiting, holding blocks, nothing computed).

Regression too: the statement marking it loading had its four targets on four lines, and
Python runs a line between targets so spread: cut short after its tier hit was counted
but before its computed tokens were set, `_settle`'s rewind took none back and the next
admission counted the hit again. Now the targets are on one line.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from itertools import count
from types import FrameType
from typing import Any

import torch
from test_llm_poll_interrupts import LineInterrupt, loaded_engine
from test_llm_submit_failures import (
    ENGINE,
    MAX_STEPS,
    PARAMS,
    assert_consistent_and_drained,
    step_until_done,
    turns,
)

from kvtier.engine.llm import LLM
from kvtier.engine.request import RequestStatus
from kvtier.engine.scheduler import Scheduler
from kvtier.offload.load_planner import LoadPlanner
from kvtier.offload.plan import TransferPlan

ADMIT = Scheduler._admit.__code__
# The first line of `_admit` after it found the request fits: blocks are taken from there.
_LINES, _FIRST = inspect.getsourcelines(Scheduler._admit)
FROM_LINE = (
    _FIRST
    + 2
    + next(
        i for i, line in enumerate(_LINES) if "if not self.pool.can_allocate(num_taken):" in line
    )
)


class FromAllocation(LineInterrupt):
    """Counts the lines of `_admit` from `FROM_LINE` on, and of `on_allocated`, while
    the first admission with a tier hit runs (`armed`)."""

    armed = False
    spent = False  # the admission it counts in ran

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.armed and frame.f_code is ADMIT and frame.f_lineno >= FROM_LINE:
            self.counting = True
        return super().line(frame, event, arg)


class HoldsTheNextLoad:
    """The worker, holding the first plan with a load submitted after the interrupt
    landed until the next `peek`: the load is still pending at the next step."""

    def __init__(self, worker: Any, landed: list[bool]) -> None:
        self.worker, self.landed = worker, landed
        self.held: TransferPlan | None = None
        self.done = False

    def submit(self, plan: TransferPlan) -> None:
        if self.landed and not self.done and any(job.is_load for job in plan.jobs):
            self.held, self.done = plan, True
            return
        self.worker.submit(plan)

    def peek(self) -> Any:
        if self.held is not None:
            plan, self.held = self.held, None
            self.worker.submit(plan)
            self.worker.flush()
        return self.worker.peek()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def expected_logits() -> list[torch.Tensor]:
    """Return the logits of the second turn in an engine without offloading."""
    first, second, _ = turns()
    llm = LLM(None, engine=dataclasses.replace(ENGINE, keep_logits=True))
    llm.generate(first, PARAMS)
    return [o.logits for o in llm.generate(second, PARAMS)]


def served_with(tracer: FromAllocation, expected: list[torch.Tensor]) -> None:
    """Run the second turn by `step` under `tracer`, each interrupted step called again;
    check it ends as an engine without offloading, drained with no block leaked."""
    llm, arm = loaded_engine()
    with llm:  # shut down however the run ends
        assert llm.offload is not None
        llm.engine_config = dataclasses.replace(llm.engine_config, keep_logits=True)
        llm.offload.worker = HoldsTheNextLoad(llm.offload.worker, tracer.landed)
        scheduler = llm.scheduler
        offload, admit = scheduler.offload, scheduler._admit
        assert offload is not None
        lookup = offload.lookup

        def looking_up(*args: Any) -> int:
            num = lookup(*args)
            tracer.armed = tracer.armed or (num > 0 and not tracer.spent)
            return num

        def admitting(*args: Any, **kwargs: Any) -> Any:
            try:
                return admit(*args, **kwargs)
            finally:
                tracer.spent = tracer.spent or tracer.counting  # one admission only
                tracer.armed = tracer.counting = False

        offload.lookup = looking_up  # type: ignore[method-assign]
        scheduler._admit = admitting  # type: ignore[method-assign]
        _, second, _ = turns()
        arm()
        requests = [llm.add_request(prompt, PARAMS) for prompt in second]
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            for _ in range(MAX_STEPS):
                if not scheduler.has_unfinished():
                    break
                try:
                    llm.step()
                except KeyboardInterrupt:
                    continue
        finally:
            sys.settrace(previous)
        assert tracer.landed == [True], "the interrupt never landed"
        unfinished = [r.request_id for r in requests if r.status is not RequestStatus.FINISHED]
        assert not unfinished, f"never finished: {unfinished}"
        for request, logits in zip(requests, expected, strict=True):
            got = torch.stack(request.kept_logits)
            diff = float((got - logits).abs().max())
            assert diff < 1e-4, f"{request.request_id}: logits off by {diff}"
        assert_consistent_and_drained(llm, arm)
        llm.offload.worker.check_invariants()


def test_an_interrupt_at_any_line_of_admitting_a_load() -> None:
    """A Ctrl-C at the 1st, 2nd, ... line run in the first admission with a tier hit,
    from its taking blocks from the pool on (with `LoadPlanner.on_allocated`), until past
    the last line."""
    expected = expected_logits()
    codes = (ADMIT, LoadPlanner.on_allocated.__code__)
    for n in count(1):
        tracer = FromAllocation(n, codes)
        try:
            served_with(tracer, expected)
        except AssertionError as exc:
            if not tracer.landed and "never landed" in str(exc):  # past the last line
                assert n > 10, f"only {n - 1} lines ran"
                return
            raise AssertionError(f"interrupted at line {n}: {exc}") from exc


def test_an_interrupt_at_any_line_of_marking_a_request_loading_counts_its_hit_once() -> None:
    """A Ctrl-C at each line of `_admit` from its loading commit on (the first admission
    with a tier hit): once `_settle` ran, a request rewound (its load never queued)
    counts no tier hit tokens of that admission, one loading counts them once.

    Regression: the commit spread its four targets over four lines; cut short after the
    hit count but before the computed tokens, the rewind took nothing back."""
    _, second, _ = turns()
    commit_line = _FIRST + next(i for i, line in enumerate(_LINES) if "if num_external:" in line)
    for n in count(1):
        llm, arm = loaded_engine()
        scheduler = llm.scheduler
        offload = scheduler.offload
        assert offload is not None
        tracer = LineInterrupt(n, (ADMIT,))
        seen: dict[str, tuple[int, int]] = {}  # request: hit count before, tier hit
        lookup = offload.lookup

        def looking_up(request: Any, *args: Any, lookup: Any = lookup, seen: Any = seen) -> int:
            num = lookup(request, *args)
            if num and not seen:
                seen[request.request_id] = (request.num_external_tokens_total, num)
            return num

        def line(
            frame: FrameType, event: str, arg: Any, tracer: Any = tracer, seen: Any = seen
        ) -> Any:
            tracer.counting = bool(seen) and frame.f_lineno >= commit_line
            return LineInterrupt.line(tracer, frame, event, arg)

        tracer.line = line  # type: ignore[method-assign]
        offload.lookup = looking_up  # type: ignore[method-assign]
        requests = {r.request_id: r for r in (llm.add_request(p, PARAMS) for p in second)}
        sys.settrace(tracer)
        try:
            for _ in range(MAX_STEPS):
                try:
                    llm.step()
                except KeyboardInterrupt:
                    break
                if seen:
                    break
        finally:
            sys.settrace(None)
        if not tracer.landed:  # past the last line
            assert n > 3, f"only {n - 1} lines ran"
            llm.shutdown()
            return
        scheduler._settle()
        ((request_id, (before, num)),) = seen.items()
        request = requests[request_id]
        loading = request.status is RequestStatus.WAITING_FOR_LOAD
        want = before + num if loading else before
        got = request.num_external_tokens_total
        assert got == want, f"interrupted at line {n}: {request_id} counts {got}, not {want}"
        arm()
        step_until_done(llm)
        assert_consistent_and_drained(llm, arm)
        llm.shutdown()
