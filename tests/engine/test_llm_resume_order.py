"""Requests whose loads end in the same poll go back to `waiting` in the order they were
admitted (`Scheduler.apply_offload`), finished or failed, whatever the report's order."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_llm_offload import MIB, PARAMS, FailingLoads, Synchronous
from test_llm_poll_interrupts import interrupt_once

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.offload.config import OffloadConfig
from kvtier.offload.transfers import ReportOutcome


class Reversed:
    """Wrap an outcome source so that each outcome lists its loads in reverse."""

    def __init__(self, unapplied: Any) -> None:
        self.unapplied = unapplied

    def __call__(self) -> ReportOutcome:
        outcome = self.unapplied()
        return ReportOutcome(
            outcome.finished_loads[::-1], outcome.failed_loads[::-1], outcome.suspect_gpu_blocks
        )


def back_from_the_tier(loads: str) -> tuple[LLM, list[str]]:
    """Return an engine whose three requests, queued, all load from the CPU tier (the
    loads end before the step polls; with `loads` "failed" they fail), and their ids."""
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(16)] for _ in range(3)]
    engine = EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64)
    llm = LLM(ModelConfig.tiny(), kv_offload=OffloadConfig(cpu_bytes=8 * MIB), engine=engine)
    llm.generate(prompts, PARAMS)
    llm.drain()
    llm.pool.discard_all_keys()  # the GPU cache forgets them: the CPU tier serves them
    assert llm.offload is not None
    worker = llm.offload.worker
    if loads == "failed":
        worker = FailingLoads(worker)
    llm.offload.worker = Synchronous(worker)  # every load ends before the step polls
    if loads.endswith("in reverse"):
        llm.offload.unapplied_outcome = Reversed(  # type: ignore[method-assign]
            llm.offload.unapplied_outcome
        )
    return llm, [llm.add_request([*p, 1], PARAMS).request_id for p in prompts]


@pytest.mark.parametrize("loads", ["finished", "failed", "finished, reported in reverse"])
def test_requests_back_from_one_poll_keep_their_admission_order(loads: str) -> None:
    """Regression: each was put in front of `waiting` in turn, so the last one back ran
    first: three loads ending in one poll queued as [req-5, req-4, req-3]."""
    llm, admitted = back_from_the_tier(loads)
    scheduler = llm.scheduler
    apply = scheduler.apply_offload
    queued: list[list[str]] = []

    def applying(outcome: ReportOutcome) -> None:
        apply(outcome)
        if outcome.finished_loads or outcome.failed_loads:
            queued.append([r.request_id for r in scheduler.waiting])

    scheduler.apply_offload = applying  # type: ignore[method-assign]
    llm.step()
    assert list(scheduler.loading) == [], "the loads did not all end in the first poll"
    assert queued == [admitted]
    llm.step()
    assert [r.request_id for r in scheduler.running] == admitted
    requests = list(scheduler.running)
    while scheduler.has_unfinished():
        llm.step()
    assert all(r.num_external_tokens_total == (0 if loads == "failed" else 16) for r in requests)
    llm.shutdown()


@pytest.mark.parametrize("loads", ["finished", "failed"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_an_interrupt_among_the_resumes_keeps_the_order(loads: str, where: str) -> None:
    """A Ctrl-C before or after the second request goes back to `waiting`: the next step
    applies the outcome again first, and the requests still run in admission order."""
    llm, admitted = back_from_the_tier(loads)
    scheduler = llm.scheduler
    resume = scheduler._resume
    interrupted: list[bool] = []
    calls: list[str] = []

    def resuming(request: Any) -> None:
        calls.append(request.request_id)
        if len(calls) == 2 and where == "before":
            interrupt_once(interrupted, "Ctrl-C before the second resume")
        resume(request)
        if len(calls) == 2 and where == "after":
            interrupt_once(interrupted, "Ctrl-C after the second resume")

    scheduler._resume = resuming  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    assert interrupted == [True]
    llm.step()  # applies the outcome again, then admits
    assert [r.request_id for r in scheduler.running] == admitted
    while scheduler.has_unfinished():
        llm.step()
    llm.drain()
    assert llm.pool.num_free() == llm.pool.num_usable_blocks
    llm.shutdown()
