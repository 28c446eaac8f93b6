"""A step cut short (Ctrl-C) right after it finished a request, or as it admitted one
without a tier hit: the engine's counters and the offload side still see the request.

Regression: `LLM.step` counted the hit tokens of the requests `Scheduler.complete`
returned; cut short after `complete` finished one (handling the next), the request was
returned by the next step but never counted (16 of 20 local hit tokens counted). Now
`_finish` keeps it in `Scheduler.uncounted` in the statement that finishes it, and each
step counts those (`LLM._count_finished`), telling the offload side they finished too.

Regression too: `_admit` set a request's computed tokens and counted its local hit in
two statements; cut short in between, `_settle` took it as admitted and its hit was
never counted. The offload side tracks it whether or not `on_allocated` ran (its first
scheduled work sends its whole table), so its blocks are stored either way.
"""

from __future__ import annotations

import sys
from itertools import count
from types import FrameType
from typing import Any

from test_llm_admit_interrupts import ADMIT, FROM_LINE
from test_llm_poll_interrupts import LineInterrupt, interrupt_once, loaded_engine, step_through
from test_llm_submit_failures import (
    PARAMS,
    assert_consistent_and_drained,
    new_engine,
    reference,
    turns,
)

from kvtier.core.keys import make_key
from kvtier.engine.llm import EngineConfig
from kvtier.engine.request import Request
from kvtier.engine.sampling import FinishReason

# The whole first turn stays cached on the GPU: the second admits with local hits only.
ROOMY = EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=24)


def test_hit_tokens_of_a_request_finished_in_a_cut_short_step_are_counted() -> None:
    llm, arm = loaded_engine()
    scheduler = llm.scheduler
    finish = scheduler._finish
    interrupted: list[bool] = []

    def finishing(request: Any, now: float) -> None:
        finish(request, now)
        interrupt_once(interrupted, "Ctrl-C after the step finished a request")

    scheduler._finish = finishing  # type: ignore[method-assign]
    local, external = llm.stats.num_local_hit_tokens, llm.stats.num_external_hit_tokens
    _, second, _ = turns()
    requests = stepped(llm, second)
    assert interrupted == [True], "the interrupt never landed"
    done = [r for r in requests if r.finish_reason is not FinishReason.ABORT]
    assert sum(r.num_external_tokens_total for r in done) > 0, "no tier hit"
    assert llm.stats.num_local_hit_tokens - local == sum(r.num_local_tokens_total for r in done)
    assert llm.stats.num_external_hit_tokens - external == sum(
        r.num_external_tokens_total for r in done
    )
    assert_consistent_and_drained(llm, arm)
    llm.shutdown()


def stepped(llm: Any, prompts: list[list[int]]) -> list[Request]:
    """Run `prompts` by `add_request` and `step`, each interrupted step called again;
    the last step returns what the one before finished."""
    requests = step_through(llm, prompts)
    llm.step()
    return requests


class InLocalAdmission(LineInterrupt):
    """Counts the lines `_admit` runs from its taking blocks from the pool on (the
    `FROM_LINE` of the admit tests), for a request with a local hit and no tier hit."""

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        names = frame.f_locals
        self.counting = (
            frame.f_lineno >= FROM_LINE
            and names.get("num_local", 0) > 0
            and names.get("num_external") == 0
        )
        return super().line(frame, event, arg)


def test_a_local_hit_admission_cut_short_at_any_line_is_counted_once_and_stored() -> None:
    """A Ctrl-C at the 1st, 2nd, ... line of the first admission with a local hit and no
    tier hit, from its taking blocks on, until past the last line: each request counts
    its local hit once, and its blocks are stored (the offload side tracks it).

    Regression: cut short after its computed tokens were set, before its hit was counted,
    `_settle` took it as admitted and the hit was never counted (0 of 24 tokens)."""
    first, second, _ = turns()
    expected = reference([first, second], ROOMY)[1:]
    for n in count(1):
        tracer = InLocalAdmission(n, (ADMIT,))
        try:
            served_local_hits(tracer, expected)
        except AssertionError as exc:
            if not tracer.landed:  # past the last line
                assert n > 5, f"only {n - 1} lines ran"
                return
            raise AssertionError(f"interrupted at line {n}: {exc}") from exc


def served_local_hits(tracer: LineInterrupt, expected: list[Any]) -> None:
    """Run the second turn by `step` under `tracer` (the first cached on the GPU and
    stored); check its tokens, hit counts and stores, and that it drains."""
    first, second, _ = turns()
    llm, arm = new_engine(ROOMY)
    with llm:  # shut down however the run ends
        llm.generate(first, PARAMS)
        llm.drain()
        offload = llm.offload
        assert offload is not None
        sys.settrace(tracer)
        try:
            requests = stepped(llm, second)
        finally:
            sys.settrace(None)
        assert tracer.landed == [True], "the interrupt never landed"
        assert [[tuple(r.output_token_ids) for r in requests]] == expected
        llm.drain()
        index = offload.scheduler.index
        for request in requests:
            assert request.num_local_tokens_total == 24, request.request_id
            full = request.num_tokens // llm.layout.hash_block_size
            missing = [
                pos
                for pos, h in enumerate(request.block_hashes[:full])
                if index.cached_block(make_key(h, 0)) is None
            ]
            assert not missing, f"{request.request_id}: blocks {missing} never stored"
        assert_consistent_and_drained(llm, arm)
