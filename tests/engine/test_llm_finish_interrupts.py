"""Interrupts (Ctrl-C) while `Scheduler.complete` finishes a request (`_finish`).

Regression: `_finish` marked the request FINISHED first; cut short after that, the
step's abort skipped it (a finished request is left as is). Caught before it left
`running`, it ran on and finished again, one token past `max_tokens`; caught after, its
offload state and GPU blocks were never released (6 of 19 blocks leaked). Now it is
marked FINISHED last: cut short, it is aborted with the step's other requests.
"""

from __future__ import annotations

import sys
from itertools import count

from test_llm_poll_interrupts import LineInterrupt
from test_llm_submit_failures import (
    MAX_STEPS,
    PARAMS,
    assert_consistent_and_drained,
    new_engine,
    prompts,
    reference,
)

from kvtier.engine.request import RequestStatus
from kvtier.engine.sampling import FinishReason
from kvtier.engine.scheduler import Scheduler


def test_an_interrupt_at_any_line_of_finishing_a_request() -> None:
    """A Ctrl-C at the 1st, 2nd, ... line run in `_finish` (the first request to finish),
    the turn run by `step`; until past the last line. A request the interrupted step
    aborted has a prefix of its tokens; the others all of them."""
    prompt_list = prompts(4, 20)
    (expected,) = reference([prompt_list])
    for n in count(1):
        llm, arm = new_engine()
        tracer = LineInterrupt(n, (Scheduler._finish.__code__,))
        tracer.counting = True
        requests = [llm.add_request(prompt, PARAMS) for prompt in prompt_list]
        sys.settrace(tracer)
        try:
            for _ in range(MAX_STEPS):
                if not llm.scheduler.has_unfinished():
                    break
                try:
                    llm.step()
                except KeyboardInterrupt:
                    continue
        finally:
            sys.settrace(None)
        if not tracer.landed:  # past the last line
            assert n > 4, f"only {n - 1} lines ran"
            llm.shutdown()
            return
        try:
            assert all(r.status is RequestStatus.FINISHED for r in requests)
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
