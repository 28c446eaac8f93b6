"""A Ctrl-C at any line run once a step has finished a request (`Scheduler.complete`,
`_finish`, the rest of `LLM.step`): every request the engine finished is returned by
`step` exactly once, the next step returning those an interrupted one finished.

Regression: `step` kept the requests `complete` returned only in a statement after it
(a line event between `complete` returning and the list being stored), and cleared its
list a line before returning it; an interrupt in `complete` after it finished one
request, handling the next, lost the first too. A caller driving `step` never saw them.
"""

from __future__ import annotations

import sys
from itertools import count
from typing import Any

from test_llm_poll_interrupts import LineInterrupt
from test_llm_submit_failures import (
    MAX_STEPS,
    PARAMS,
    assert_consistent_and_drained,
    new_engine,
    prompts,
    reference,
)

from kvtier.engine.llm import LLM
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import FinishReason
from kvtier.engine.scheduler import Scheduler


def test_an_interrupt_at_any_line_after_a_request_finished_loses_none() -> None:
    prompt_list = prompts(2, 20)
    (expected,) = reference([prompt_list])
    codes = (LLM.step.__code__, Scheduler.complete.__code__, Scheduler._finish.__code__)
    for n in count(1):
        llm, arm = new_engine()
        tracer = LineInterrupt(n, codes)
        finish = llm.scheduler._finish

        def finishing(request: Any, now: float, finish: Any = finish, tracer: Any = tracer) -> None:
            tracer.counting = True  # from the first finish on
            finish(request, now)

        llm.scheduler._finish = finishing  # type: ignore[method-assign]
        requests = [llm.add_request(prompt, PARAMS) for prompt in prompt_list]
        returned: list[Request] = []
        sys.settrace(tracer)
        try:
            for _ in range(MAX_STEPS):
                finishing_step = not llm.scheduler.has_unfinished()  # returns what is left
                try:
                    returned += llm.step()
                except KeyboardInterrupt:
                    continue
                if finishing_step:
                    break
        finally:
            sys.settrace(None)
        if not tracer.landed:  # past the last line
            assert n > 10, f"only {n - 1} lines ran"
            llm.shutdown()
            return
        try:
            assert all(r.status is RequestStatus.FINISHED for r in requests)
            ids = [r.request_id for r in returned]
            done = [r.request_id for r in requests if r.finish_reason is not FinishReason.ABORT]
            assert sorted(ids) == sorted(done), f"step returned {ids} of {done}"
            for request, tokens in zip(requests, expected, strict=True):
                got = tuple(request.output_token_ids)
                if request.finish_reason is FinishReason.ABORT:
                    assert got == tokens[: len(got)], f"{request.request_id}: {got}"
                else:
                    assert got == tokens, f"{request.request_id}: {got}, not {tokens}"
            assert_consistent_and_drained(llm, arm)
        except AssertionError as exc:
            raise AssertionError(f"interrupted at line {n}: {exc}") from exc
        llm.shutdown()
