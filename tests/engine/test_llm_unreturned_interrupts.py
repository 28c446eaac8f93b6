"""A Ctrl-C in a step after it finished requests, while it hands them to the offload side
or polls the worker: the next step returns them.

Regression: `step` returned the requests it finished only at its end; cut short in
`OffloadSide.finish_step` or `poll` (after `Scheduler.complete`), it lost them for a
caller driving `step` (`generate` was unaffected: it waits for its requests' status).
"""

from __future__ import annotations

from typing import Any

import pytest
from test_llm_poll_interrupts import interrupt_once, loaded_engine
from test_llm_submit_failures import (
    MAX_STEPS,
    PARAMS,
    assert_consistent_and_drained,
    reference,
    turns,
)

from kvtier.engine.request import Request, RequestStatus


@pytest.mark.parametrize("where", ["finish_step", "poll"])
def test_requests_an_interrupted_step_finished_come_back_from_the_next(where: str) -> None:
    llm, arm = loaded_engine()
    offload = llm.offload
    assert offload is not None
    interrupted: list[bool] = []
    finish_step, poll = offload.finish_step, offload.poll
    finished: list[Any] = []  # what the step being run finished

    def finishing(requests: Any) -> None:
        finished[:] = requests
        finish_step(requests)
        if finished and where == "finish_step":
            interrupt_once(interrupted, "Ctrl-C after OffloadSide.finish_step")

    def polling() -> Any:
        outcome = poll()
        if finished and where == "poll":
            interrupt_once(interrupted, "Ctrl-C after OffloadSide.poll")
        return outcome

    offload.finish_step = finishing  # type: ignore[method-assign]
    offload.poll = polling  # type: ignore[method-assign]
    first, second, _ = turns()
    arm()
    requests = [llm.add_request(prompt, PARAMS) for prompt in second]
    returned: list[Request] = []
    for _ in range(MAX_STEPS):
        try:
            returned += llm.step()
        except KeyboardInterrupt:
            continue
        if not llm.scheduler.has_unfinished() and len(returned) >= len(requests):
            break
    assert interrupted == [True], "the interrupt never landed"
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    ids = sorted(r.request_id for r in returned)
    assert ids == sorted(r.request_id for r in requests), f"step returned {ids}"
    assert [[tuple(r.output_token_ids) for r in requests]] == reference([first, second])[1:]
    assert_consistent_and_drained(llm, arm)
    llm.shutdown()
