"""A Ctrl-C at any line of `LLM.abort_request` (`Scheduler.abort`), then the same call again.

Regression: `abort` took the request out of `waiting` and `running` first, and only then
told the offload side, freed its blocks and marked it FINISHED; a Ctrl-C in between left
it unfinished in no queue: the retried `abort_request` raised "not a request of this
engine", its blocks (3 of the 31 here) were never freed and it never finished.
Now it stays in its queues until it is FINISHED, and an abort cut short and never
retried is ended by the next step (`_settle`).
"""

from __future__ import annotations

import sys
from itertools import count
from typing import Any

import pytest
from test_llm_abort import LONG, MIB, start_a_load
from test_llm_lifecycle import PARAMS, assert_idle
from test_llm_poll_interrupts import LineInterrupt

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.queue_recovery import QueueRecovery
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import FinishReason
from kvtier.engine.scheduler import Scheduler
from kvtier.offload.config import OffloadConfig

ENGINE = EngineConfig(num_gpu_blocks=32, block_size=4, max_num_seqs=1)
PROMPTS = [[*range(10), 50], [*range(10), 60]]  # a shared prefix of two blocks
CODES = tuple(
    f.__code__ for f in (Scheduler.abort, QueueRecovery._free_blocks, QueueRecovery._free_unfreed)
)


def aborted_with_an_interrupt(llm: LLM, victim: Request, n: int, retry: bool = True) -> bool:
    """Abort `victim` with a Ctrl-C at the `n`th line run, then again (`retry`); return
    True if the Ctrl-C landed. The retry must find the request and finish it."""
    tracer = LineInterrupt(n, CODES)
    tracer.counting = True
    sys.settrace(tracer)
    try:
        llm.abort_request(victim)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    if not retry:
        return bool(tracer.landed)
    llm.abort_request(victim)
    assert (victim.status, victim.finish_reason) == (RequestStatus.FINISHED, FinishReason.ABORT)
    return bool(tracer.landed)


@pytest.mark.parametrize("retry", [True, False], ids=["retried", "stepped_on"])
@pytest.mark.parametrize("when", ["waiting", "running"])
def test_an_interrupt_at_any_line_of_an_abort(when: str, retry: bool) -> None:
    """Not retried, the abort ends at the next step, or (the Ctrl-C came before it
    began) the request runs to its end with the tokens of an engine never interrupted,
    never on with its blocks freed under it."""
    expected = [o.output_token_ids for o in LLM(None, engine=ENGINE).generate(PROMPTS, LONG)]
    for n in count(1):
        llm = LLM(None, engine=ENGINE)
        first, second = (llm.add_request(prompt, LONG) for prompt in PROMPTS)
        llm.step()  # max_num_seqs=1: the first runs, the second waits
        victim, survivor = (first, second) if when == "running" else (second, first)
        try:
            landed = aborted_with_an_interrupt(llm, victim, n, retry)
            returned: list[Any] = []
            while llm.scheduler.has_unfinished():
                returned += llm.step()
            assert victim.status is RequestStatus.FINISHED, "it never finished"
            if victim.finish_reason is FinishReason.ABORT:
                assert victim.status is RequestStatus.FINISHED
                assert returned == [survivor]
            else:
                assert not retry, "the retry did not abort it"  # cut short before it began
                assert sorted(returned, key=lambda r: r.request_id) == [first, second]
            assert [tuple(r.output_token_ids) for r in returned] == [
                expected[PROMPTS.index(r.prompt_token_ids)] for r in returned
            ]
            assert_idle(llm)
        except (AssertionError, ValueError) as exc:
            raise AssertionError(f"interrupted at line {n}: {exc!r}") from exc
        if not landed:  # past the last line
            assert n > 6, f"only {n - 1} lines ran"
            return


def test_an_interrupt_at_any_line_of_an_abort_while_a_load_is_in_flight() -> None:
    engine = EngineConfig(num_gpu_blocks=12, block_size=4)
    prompt = list(range(60, 92))
    (fresh,) = LLM(None, engine=engine).generate([prompt], PARAMS)
    for n in count(1):  # always retried: a load cut short is for other tests
        with LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=engine) as llm:
            request = start_a_load(llm, prompt)
            try:
                landed = aborted_with_an_interrupt(llm, request, n)
                assert_idle(llm)
                (again,) = llm.generate([prompt], PARAMS)
                assert again.output_token_ids == fresh.output_token_ids
                assert_idle(llm)
            except (AssertionError, ValueError) as exc:
                raise AssertionError(f"interrupted at line {n}: {exc!r}") from exc
        if not landed:
            assert n > 6, f"only {n - 1} lines ran"
            return


def test_aborting_another_engines_finished_request_of_the_same_id_leaves_a_cut_short_abort() -> (
    None
):
    """An abort of `req-0` was cut short once it was FINISHED, still in `waiting`. The
    caller then aborts a finished request of another engine, `req-0` there too (a
    finished request is left as is, whoever's it is). The cut-short abort is untouched:
    the next step ends it, nothing runs, the engine is idle.
    Mutation: `abort` matched the pending abort by id, not by request (it dropped the
    pending abort: `req-0` stayed in `waiting`, FINISHED, the engine never idle)."""
    llm = LLM(None, engine=ENGINE)
    caught = llm.add_request(PROMPTS[0], LONG)
    scheduler = llm.scheduler
    scheduler._aborting[caught.request_id] = caught  # `abort`, cut short past its mark:
    caught.status, caught.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
    other = LLM(None, engine=ENGINE)
    stranger = other.add_request(PROMPTS[1], PARAMS)
    while other.scheduler.has_unfinished():
        other.step()
    assert stranger.request_id == caught.request_id
    llm.abort_request(stranger)
    assert llm.step() == []
    assert not scheduler.has_unfinished()
    assert caught.output_token_ids == []
    assert_idle(llm)
