"""Interrupts (Ctrl-C) while `Scheduler.schedule` moves a request between its queues.

Regression: `schedule` took a request out of `running` (`running.pop()`) before
`_preempt` queued it again, and out of `waiting` (`waiting.popleft()`) before adding it
to `loading` or `running`; a Ctrl-C in between left the request in no queue: a turn run
by `step` never finished it (it stepped until nothing else was left, the request's
blocks held for good). Now a move adds the request to its new queue first and takes it
from the old one last, and the next schedule finishes a move cut short (`_settle`).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import Any

import pytest
from test_llm_poll_interrupts import (
    LineInterrupt,
    interrupt_once,
    loaded_engine,
    served_after_an_interrupt,
)
from test_llm_submit_failures import (
    MAX_STEPS,
    PARAMS,
    assert_consistent_and_drained,
    new_engine,
    prompts,
    reference,
)

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.queue_recovery import QueueRecovery
from kvtier.engine.request import RequestStatus
from kvtier.engine.scheduler import Scheduler

# Four prompts of 16 tokens in 7 usable blocks of 4: running requests are preempted.
TIGHT = EngineConfig(block_size=4, num_gpu_blocks=8, max_num_batched_tokens=24)


class PoppingRaises(list[Any]):
    """`running`: its first `pop` pops, then raises a Ctrl-C."""

    def __init__(self, items: Any, interrupted: list[bool]) -> None:
        super().__init__(items)
        self.interrupted = interrupted

    def pop(self, *args: Any) -> Any:
        item = super().pop(*args)
        interrupt_once(self.interrupted, "Ctrl-C right after running.pop()")
        return item


class PopLeftRaises(deque[Any]):
    """`waiting`: its first `popleft` of a request admitted to `loading` (or, `loading`
    False, to `running`) pops, then raises a Ctrl-C."""

    def __init__(self, items: Any, interrupted: list[bool], loading: bool) -> None:
        super().__init__(items)
        self.interrupted, self.loading = interrupted, loading

    def popleft(self) -> Any:
        item = super().popleft()
        if (item.status is RequestStatus.WAITING_FOR_LOAD) == self.loading:
            interrupt_once(self.interrupted, f"Ctrl-C right after waiting.popleft() ({item})")
        return item


def stepped_to_the_end(llm: LLM, prompt_list: list[list[int]]) -> list[Any]:
    """Run `prompt_list` by `add_request` and `step`, each interrupted step called again,
    at most MAX_STEPS steps; return their tokens."""
    requests = [llm.add_request(prompt, PARAMS) for prompt in prompt_list]
    for _ in range(MAX_STEPS):
        if not llm.scheduler.has_unfinished():
            break
        try:
            llm.step()
        except KeyboardInterrupt:
            continue
    unfinished = [r.request_id for r in requests if r.status is not RequestStatus.FINISHED]
    assert not unfinished, f"never finished: {unfinished}"
    return [tuple(r.output_token_ids) for r in requests]


def served_after_a_preemption_interrupt(llm: LLM, arm: Any, landed: list[bool]) -> None:
    """Run the tight turn by `step`; check it ends as an engine without offloading."""
    served = stepped_to_the_end(llm, prompts(4, 16))
    assert landed == [True], "the interrupt never landed"
    assert [served] == reference([prompts(4, 16)], TIGHT)
    assert_consistent_and_drained(llm, arm)
    llm.shutdown()


def served_with_running_raising(raising: Callable[[Any, list[bool]], list[Any]]) -> None:
    """Run the tight turn with `running` wrapped in `raising` (which raises a Ctrl-C
    once, noting it in the list it is given) during each `schedule`; check it ends as
    an engine without offloading."""
    llm, arm = new_engine(TIGHT)
    interrupted: list[bool] = []
    scheduler = llm.scheduler
    schedule = scheduler.schedule

    def scheduling() -> Any:
        scheduler.running = raising(scheduler.running, interrupted)
        try:
            return schedule()
        finally:
            scheduler.running = list(scheduler.running)

    scheduler.schedule = scheduling  # type: ignore[method-assign]
    served_after_a_preemption_interrupt(llm, arm, interrupted)


def test_an_interrupt_right_after_a_preempted_request_left_running() -> None:
    # `running.pop()` is a preemption's (or `_settle`'s)
    served_with_running_raising(PoppingRaises)


def test_an_interrupt_at_any_line_of_a_preemption() -> None:
    """A Ctrl-C at the 1st, 2nd, ... line run in the first `_preempt` (with the frees it
    calls) and the `_settle` after it; until past the last line."""
    functions = (
        Scheduler._preempt,
        Scheduler._drop_kv,
        QueueRecovery._free_unfreed,
        QueueRecovery._settle,
    )
    codes = tuple(f.__code__ for f in functions)
    for n in count(1):
        llm, arm = new_engine(TIGHT)
        tracer = LineInterrupt(n, codes)
        scheduler = llm.scheduler
        preempt, settle = scheduler._preempt, scheduler._settle
        calls: list[str] = []

        def preempting(
            request: Any, step: Any, tracer: Any = tracer, p: Any = preempt, calls: Any = calls
        ) -> None:
            tracer.counting = not calls
            calls.append("preempt")
            p(request, step)

        def settling(tracer: Any = tracer, s: Any = settle, calls: Any = calls) -> None:
            try:
                s()
            finally:
                tracer.counting = tracer.counting and not calls

        scheduler._preempt = preempting  # type: ignore[method-assign]
        scheduler._settle = settling  # type: ignore[method-assign]
        sys.settrace(tracer)
        try:
            served_after_a_preemption_interrupt(llm, arm, tracer.landed)
            assert calls, "nothing was preempted"
        except AssertionError as exc:
            if not tracer.landed and "never landed" in str(exc):  # past the last line
                assert n > 6, f"only {n - 1} lines ran"
                llm.shutdown()
                return
            raise AssertionError(f"interrupted at line {n}: {exc}") from exc
        finally:
            sys.settrace(None)


@pytest.mark.parametrize("loading", [True, False], ids=["to_loading", "to_running"])
def test_an_interrupt_right_after_an_admitted_request_left_waiting(loading: bool) -> None:
    # The turn has tier hits: its requests are admitted to `loading`, then to `running`.
    llm, arm = loaded_engine()
    interrupted: list[bool] = []
    scheduler = llm.scheduler
    scheduler.waiting = PopLeftRaises(scheduler.waiting, interrupted, loading)
    served_after_an_interrupt(llm, arm, interrupted, stepped=True)


class AppendRaises(list[Any]):
    """`running`: its first `append` raises a Ctrl-C before appending."""

    def __init__(self, items: Any, interrupted: list[bool]) -> None:
        super().__init__(items)
        self.interrupted = interrupted

    def append(self, item: Any) -> None:
        interrupt_once(self.interrupted, "Ctrl-C right before running.append()")
        super().append(item)


def test_an_interrupt_before_an_admitted_request_joined_running() -> None:
    """The head of `waiting`, marked running, never reached `running`: the next
    schedule leaves it waiting (admitted again), not dropped from every queue."""
    served_with_running_raising(AppendRaises)


class AppendLeftRaises(deque[Any]):
    """`waiting`: its first `appendleft` of a request running behind another (a
    preemption's victim, still in `running`) appends, then raises a Ctrl-C."""

    def __init__(self, items: Any, interrupted: list[bool], running: list[Any]) -> None:
        super().__init__(items)
        self.interrupted, self.running = interrupted, running

    def appendleft(self, item: Any) -> None:
        super().appendleft(item)
        if item in self.running[1:]:
            interrupt_once(self.interrupted, f"Ctrl-C right after waiting.appendleft() ({item})")


def test_a_victim_caught_in_both_queues_behind_another_is_queued_once() -> None:
    """A Ctrl-C between a preemption's `waiting.appendleft` and `running.pop`, its victim
    not the first running: the next schedule takes it out of `running` (`_settle`
    checks the last running, the victim's place), so no request is ever queued twice
    or both waiting and running, and the turn ends as one never interrupted."""
    llm, arm = new_engine(TIGHT)
    interrupted: list[bool] = []
    scheduler = llm.scheduler
    schedule = scheduler.schedule

    def scheduling() -> Any:
        scheduler.waiting = AppendLeftRaises(scheduler.waiting, interrupted, scheduler.running)
        try:
            step = schedule()
        finally:
            scheduler.waiting = deque(scheduler.waiting)
        queued = [r.request_id for r in [*scheduler.waiting, *scheduler.running]]
        queued += [*scheduler.loading]
        assert len(set(queued)) == len(queued), f"queued twice: {queued}"
        return step

    scheduler.schedule = scheduling  # type: ignore[method-assign]
    served_after_a_preemption_interrupt(llm, arm, interrupted)
