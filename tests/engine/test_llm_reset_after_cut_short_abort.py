"""`LLM.reset_prefix_cache` right after an abort that a Ctrl-C cut short, no step between.

Regression: the request stayed in its queues (the next step's `_settle` ends such an
abort), so `has_unfinished` held and the reset returned False and dropped nothing:
without offload it did nothing at all, and with a load in flight the prompt was served
again from the tier. Now the reset first ends the abort (`Scheduler.end_aborts`), so it
does what it does after a completed abort; a Ctrl-C in that is mended by a retry.
"""

from __future__ import annotations

import sys
from itertools import count

import pytest
from test_llm_abort import LONG, MIB, start_a_load
from test_llm_abort_interrupts import CODES, aborted_with_an_interrupt
from test_llm_lifecycle import PARAMS, assert_idle
from test_llm_poll_interrupts import LineInterrupt

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.queue_recovery import QueueRecovery
from kvtier.engine.request import Request, RequestStatus
from kvtier.offload.config import OffloadConfig

ENGINE = EngineConfig(num_gpu_blocks=12, block_size=4)
PROMPT = list(range(60, 92))
RESET_CODES = (*CODES, QueueRecovery.end_aborts.__code__, LLM.reset_prefix_cache.__code__)
Outcome = tuple[bool, int, tuple[int, ...], int, int]


def started(when: str) -> tuple[LLM, Request]:
    """An engine with one request `when` (waiting, running, or loading from the tier)."""
    if when == "loading":
        llm = LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=ENGINE)
        return llm, start_a_load(llm, PROMPT)
    llm = LLM(None, engine=ENGINE)
    request = llm.add_request(PROMPT, LONG)
    if when == "running":
        llm.step()
        assert request.status is RequestStatus.RUNNING
        assert any(request.block_tables)
    return llm, request


def reset_and_serve(llm: LLM, victim: Request) -> Outcome:
    """Reset with no step since the abort; return what it returned, the GPU blocks free
    right after it, then (transfers drained) the prompt's tokens and hits served again."""
    began = victim.status is RequestStatus.FINISHED or victim.request_id in llm.scheduler._aborting
    done = llm.reset_prefix_cache()
    if not began:  # the Ctrl-C came before the abort began: the request is unfinished
        assert (done, llm.scheduler.holds(victim)) == (False, True)
        llm.abort_request(victim)
        done = llm.reset_prefix_cache()
    num_free = llm.pool.num_free()
    assert not llm.scheduler.has_unfinished()
    llm.pool.check_invariants()
    assert_idle(llm)
    (again,) = llm.generate([PROMPT], PARAMS)
    assert_idle(llm)
    llm.shutdown()
    hits = again.num_local_hit_tokens, again.num_external_hit_tokens
    return done, num_free, again.output_token_ids, *hits


def completed(when: str) -> Outcome:
    """What the reset does after a completed abort, checked against a fresh engine."""
    llm, victim = started(when)
    llm.abort_request(victim)
    outcome = reset_and_serve(llm, victim)
    (fresh,) = LLM(None, engine=ENGINE).generate([PROMPT], PARAMS)
    assert outcome[2] == fresh.output_token_ids
    assert outcome[3:] == (0, 0), "a prefix cached before the reset was served"
    if when != "loading":  # the load in flight pins its blocks until it is reported
        assert outcome[:2] == (True, ENGINE.num_gpu_blocks - 1)
    return outcome


@pytest.mark.parametrize("when", ["waiting", "running", "loading"])
def test_a_reset_right_after_an_abort_cut_short_at_any_line(when: str) -> None:
    expected = completed(when)
    num_ended = 0  # aborts cut short that the reset ended
    for n in count(1):
        llm, victim = started(when)
        try:
            landed = aborted_with_an_interrupt(llm, victim, n, retry=False)
            num_ended += victim.request_id in llm.scheduler._aborting
            assert reset_and_serve(llm, victim) == expected
        except (AssertionError, ValueError) as exc:
            raise AssertionError(f"interrupted at line {n}: {exc!r}") from exc
        if not landed:  # past the last line
            assert num_ended > 4, f"only {num_ended} aborts cut short after they began"
            return


@pytest.mark.parametrize("when", ["running", "loading"])
def test_a_reset_cut_short_as_it_ends_an_abort_is_mended_by_a_retry(when: str) -> None:
    """A Ctrl-C at line 4 of the abort (it began), then at every line of the reset."""
    expected = completed(when)
    for m in count(1):
        llm, victim = started(when)
        assert aborted_with_an_interrupt(llm, victim, 4, retry=False)
        assert llm.scheduler.has_unfinished()  # the reset has an abort to end
        tracer = LineInterrupt(m, RESET_CODES)
        tracer.counting = True
        sys.settrace(tracer)
        try:
            llm.reset_prefix_cache()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        try:
            assert reset_and_serve(llm, victim) == expected
        except (AssertionError, ValueError) as exc:
            raise AssertionError(f"interrupted at line {m} of the reset: {exc!r}") from exc
        if not tracer.landed:
            assert m > 8, f"only {m - 1} lines ran"
            return
