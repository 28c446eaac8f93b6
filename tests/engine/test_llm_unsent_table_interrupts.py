"""A Ctrl-C while `LLM.step` schedules, before the offload side is told what it scheduled.

Regression: blocks a schedule gave a request reached the offload side only through that
step's plan (`ScheduledWork`, an APPEND of the new blocks, or the whole table once
`_work` cleared `needs_full_table`); a step cut short before its plan was built lost
them, and the request ran on with them: the offload side's table of it lacked them (the
engine's [1, 2, 3, 4, 5, 6], the offload side's [1, 2, 3, 4, 6]), so their KV was never
stored: a follow-up prompt hit 16 of its 24 tokens, or none when the work lost was the
request's first (its whole table: the offload side's stayed empty). Until `complete`
applies a request's work, its next work now sends its tables whole (`_grow`).
"""

from __future__ import annotations

import inspect
import sys
from itertools import count
from types import FrameType
from typing import Any

import pytest
from test_llm_poll_interrupts import LineInterrupt
from test_llm_submit_failures import MAX_STEPS, assert_consistent_and_drained, new_engine

from kvtier.engine.block_growth import BlockGrowth
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Scheduler

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=64)
PROMPT = list(range(10, 26))  # 4 blocks: the 2nd step's decode takes a 5th
EVICTING = [(7 * i) % 128 for i in range(150)]  # takes every GPU block
_lines, _first = inspect.getsourcelines(LLM.step)
STEP_TRY_LINE = _first + [line.strip() for line in _lines].index("try:")
CODES = tuple(
    f.__code__ for f in (LLM.step, Scheduler.schedule, BlockGrowth._grow, BlockGrowth._work)
)


def assert_in_step(llm: LLM, request: Request) -> None:
    """Check the offload side tracks the unfinished `request` with the engine's tables."""
    assert llm.offload is not None
    state = llm.offload.scheduler.selector.tracked.get(request.request_id)
    if request.status is not RequestStatus.FINISHED:
        assert state is not None, "not tracked"
        assert state.block_ids == request.block_tables


class UntilTry(LineInterrupt):
    """A `LineInterrupt` that stops counting at `LLM.step`'s `try`: a Ctrl-C from there
    on aborts the step's requests (their blocks with them)."""

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is LLM.step.__code__ and frame.f_lineno >= STEP_TRY_LINE:
            self.counting = False
        return super().line(frame, event, arg)


def stepped(llm: LLM, tracer: LineInterrupt | None, interrupted_step: int) -> Request:
    """Run PROMPT by `add_request` and `step`, each interrupted step called again;
    `tracer` counts its lines in the `interrupted_step`th step."""
    request = llm.add_request(PROMPT, PARAMS)
    for index in range(1, MAX_STEPS):
        if not llm.scheduler.has_unfinished():
            break
        if tracer is not None:
            tracer.counting = index == interrupted_step
        try:
            llm.step()
        except KeyboardInterrupt:
            continue
        assert_in_step(llm, request)
    return request


def num_follow_up_hit_tokens(llm: LLM, request: Request) -> int:
    """Evict the GPU cache, then return the hit tokens of `request`'s tokens plus three."""
    llm.drain()
    llm.generate([EVICTING], SamplingParams(max_tokens=1, ignore_eos=True))
    follow_up = [*request.prompt_token_ids, *request.output_token_ids, 1, 2, 3]
    (output,) = llm.generate([follow_up], SamplingParams(max_tokens=2, ignore_eos=True))
    return output.num_external_hit_tokens + output.num_local_hit_tokens


@pytest.mark.parametrize("interrupted_step", [1, 2], ids=["admission", "growth"])
def test_an_interrupt_at_any_line_of_a_schedule_loses_no_block_to_the_offload(
    interrupted_step: int,
) -> None:
    llm, _ = new_engine(ENGINE)
    expected_tokens = stepped(llm, None, 0).output_token_ids
    expected_hits = num_follow_up_hit_tokens(llm, llm.add_request(PROMPT, PARAMS))
    llm.shutdown()
    for n in count(1):
        llm, arm = new_engine(ENGINE)
        tracer = UntilTry(n, CODES)
        sys.settrace(tracer)
        try:
            request = stepped(llm, tracer, interrupted_step)
        except AssertionError as exc:
            raise AssertionError(f"interrupted at line {n}: {exc}") from exc
        finally:
            sys.settrace(None)
        where = f"interrupted at line {n}"
        assert request.output_token_ids == expected_tokens, where
        assert_consistent_and_drained(llm, arm)
        assert num_follow_up_hit_tokens(llm, request) == expected_hits, where
        llm.shutdown()
        if not tracer.landed:  # past the last line
            assert n > 10, f"only {n - 1} lines ran"
            return
