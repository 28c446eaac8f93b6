"""Plans the worker never took: their events fail back, and `drain` never spins.

Regression: when `worker.submit` raised (an interrupt, a rejected job) or the flush before
a preemption's plan failed, the plan's events were already issued but never reported, so
`has_pending_work()` stayed true and `LLM.drain()` / `shutdown()` stepped forever.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
from step_watchdog import with_watchdog

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import TransferPlan

MIB = 1 << 20
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=20, max_num_batched_tokens=24)
# A pool of 8 blocks: 4 prompts of 16 tokens preempt one another.
PREEMPTING = EngineConfig(block_size=4, num_gpu_blocks=8, max_num_batched_tokens=24)
MAX_STEPS = 2000  # a hang fails the test instead of blocking pytest


class RefusingWorker:
    """Wrap a worker: `submit` raises `error` for the first plan that `wanted` accepts."""

    def __init__(
        self, worker: Any, wanted: Callable[[TransferPlan], bool], error: BaseException
    ) -> None:
        self.worker = worker
        self.wanted = wanted
        self.error: BaseException | None = error
        self.refused: TransferPlan | None = None

    def submit(self, plan: TransferPlan) -> None:
        if self.error is not None and self.wanted(plan):
            error, self.error, self.refused = self.error, None, plan
            raise error
        self.worker.submit(plan)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def has_stores(plan: TransferPlan) -> bool:
    return any(job.is_store for job in plan.jobs)


def has_loads(plan: TransferPlan) -> bool:
    return any(job.is_load for job in plan.jobs)


def prompts(num: int, length: int, offset: int = 0) -> list[list[int]]:
    """Return `num` distinct prompts of `length` tokens."""
    return [[(offset + 7 * i + j) % 128 for j in range(length)] for i in range(num)]


def turns() -> list[list[list[int]]]:
    """Return three calls; the later ones extend the earlier prompts (tier hits)."""
    first = prompts(4, 24)
    return [first, [[*p, 1, 2, 3, 4] for p in first], prompts(4, 20, offset=50)]


def generate_all(llm: LLM, calls: list[list[list[int]]]) -> list[Any]:
    """Run `calls` in order; return their tokens, call by call."""
    return [[o.output_token_ids for o in llm.generate(call, PARAMS)] for call in calls]


def step_until_done(llm: LLM) -> None:
    """Step until no request is left."""
    while llm.scheduler.has_unfinished():
        llm.step()


def reference(calls: list[list[list[int]]], engine: EngineConfig = ENGINE) -> list[Any]:
    """Return the tokens an engine without offloading produces, call by call."""
    return generate_all(LLM(None, engine=engine), calls)


def new_engine(engine: EngineConfig = ENGINE) -> tuple[LLM, Callable[[], None]]:
    """Return an engine with a CPU tier and a function arming its step watchdog."""
    llm = LLM(None, kv_offload=OffloadConfig(cpu_bytes=8 * MIB), engine=engine)
    arm = with_watchdog(llm, MAX_STEPS)
    arm()
    return llm, arm


def recorded_plans(llm: LLM) -> list[TransferPlan]:
    """Return the list every plan the engine's offload scheduler builds from now on is
    appended to."""
    assert llm.offload is not None
    scheduler = llm.offload.scheduler
    built: list[TransferPlan] = []
    build_plan = scheduler.build_plan

    def recording(step: Any) -> TransferPlan:
        built.append(build_plan(step))
        return built[-1]

    scheduler.build_plan = recording  # type: ignore[method-assign]
    return built


def assert_consistent_and_drained(llm: LLM, arm: Callable[[], None]) -> None:
    """Check the invariants, then that `drain` returns and frees every GPU block."""
    assert llm.offload is not None
    llm.pool.check_invariants()
    llm.offload.scheduler.check_invariants()
    arm()
    llm.drain()
    assert not llm.offload.has_pending_work()
    for _ in range(MAX_STEPS):  # loads of aborted requests release their pins when done
        if llm.pool.num_free() == llm.pool.num_usable_blocks:
            break
        llm.step()
    assert llm.pool.num_free() == llm.pool.num_usable_blocks
    llm.pool.check_invariants()
    llm.offload.scheduler.check_invariants()


def assert_serves_like_offload_off(llm: LLM, arm: Callable[[], None]) -> None:
    """Serve every turn again: tokens match an engine without offloading."""
    calls = turns()
    arm()
    assert generate_all(llm, calls) == reference(calls)
    arm()
    llm.shutdown()


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt("Ctrl-C"), ValueError("rejected job")], ids=repr
)
def test_a_refused_store_plan_fails_its_stores(error: BaseException) -> None:
    llm, arm = new_engine()
    assert llm.offload is not None
    worker = RefusingWorker(llm.offload.worker, has_stores, error)
    llm.offload.worker = worker
    with pytest.raises(type(error), match=str(error.args[0])):
        generate_all(llm, turns())
    assert worker.refused is not None
    assert_consistent_and_drained(llm, arm)
    store_blocks = sum(job.num_blocks for job in worker.refused.jobs if job.is_store)
    assert llm.offload.totals.num_failed_stores == store_blocks
    assert_serves_like_offload_off(llm, arm)


def test_a_refused_load_plan_makes_its_request_recompute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The loading request is not part of the failed step: it survives and recomputes,
    all of it (a load never issued names no suspect blocks, so nothing is kept); the
    warning says so (old code: "recomputing tokens [0, 24)", naming no load or choice)."""
    llm, arm = new_engine()
    assert llm.offload is not None
    first, second, _ = turns()
    llm.generate(first, PARAMS)
    llm.drain()
    worker = RefusingWorker(llm.offload.worker, has_loads, ValueError("rejected job"))
    llm.offload.worker = worker
    prompt = second[0]
    request = llm.add_request(prompt, PARAMS)
    with pytest.raises(ValueError, match="rejected job"):
        step_until_done(llm)
    assert worker.refused is not None
    llm.pool.check_invariants()
    llm.offload.scheduler.check_invariants()
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.load_failure"):
        step_until_done(llm)
    (message,) = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert re.fullmatch(
        rf"load of {request.request_id} \(tokens \[0, 24\)\) failed: recomputing the "
        "request from token 0",
        message,
    ), message
    totals = llm.offload.totals
    assert totals.num_failed_loads == 1
    # Each event counts once, however many polls follow (the drain's progress mark).
    assert totals.num_reported_events == totals.num_issued_events
    assert request.num_external_tokens_total == 0
    expected = reference([first, [prompt]])[1][0]
    assert tuple(request.output_token_ids) == expected
    assert_consistent_and_drained(llm, arm)
    assert_serves_like_offload_off(llm, arm)


def test_a_failed_preemption_flush_fails_the_plan() -> None:
    """The tiny pool forces preemptions; the first flush before a plan with jobs fails."""
    llm, arm = new_engine(PREEMPTING)
    offload = llm.offload
    assert offload is not None
    built = recorded_plans(llm)
    flush = offload.worker.flush
    armed = [True]

    def flaky_flush() -> None:
        if armed[0] and built and built[-1].need_flush and built[-1].jobs:
            armed[0] = False
            raise RuntimeError("injected flush failure")
        flush()

    offload.worker.flush = flaky_flush
    calls = [prompts(4, 16), prompts(4, 16, offset=3)]
    with pytest.raises(RuntimeError, match="injected flush failure"):
        generate_all(llm, calls)
    assert not armed[0], "no preemption with transfers happened"
    assert_consistent_and_drained(llm, arm)
    arm()
    assert generate_all(llm, calls) == reference(calls, PREEMPTING)
    llm.shutdown()


class LosingWorker:
    """Wrap a worker that silently drops the first plan with stores (never reports it)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.lost: TransferPlan | None = None

    def submit(self, plan: TransferPlan) -> None:
        if self.lost is None and has_stores(plan):
            self.lost = plan
            return
        self.worker.submit(plan)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_drain_raises_instead_of_spinning_on_events_never_reported() -> None:
    llm, arm = new_engine()
    assert llm.offload is not None
    worker = LosingWorker(llm.offload.worker)
    llm.offload.worker = worker
    llm.generate(prompts(2, 12), PARAMS)
    message = r"drain\(\) made no progress .*blocks queued or in flight to the CPU tier"
    arm()
    with pytest.raises(RuntimeError, match=message):
        llm.drain()
    assert worker.lost is not None
    arm()
    with pytest.raises(RuntimeError, match=message):
        llm.shutdown()
    llm.shutdown()  # the worker was stopped all the same
    with pytest.raises(RuntimeError, match="LLM is shut down"):
        llm.generate([[1, 2, 3]], PARAMS)


def test_drain_names_the_stores_a_reset_abandoned_when_they_never_report() -> None:
    """The message named blocks and demotion keys only, not that a reset had abandoned
    the transfers (and a reset lets go of an abandoned demotion's key: "0 demotions")."""
    llm, arm = new_engine()
    assert llm.offload is not None
    worker = LosingWorker(llm.offload.worker)
    llm.offload.worker = worker
    llm.generate(prompts(2, 12), PARAMS)
    assert worker.lost is not None
    assert not llm.offload.scheduler.reset()  # the lost stores are abandoned
    arm()
    message = r"; 1 store or demotion event issued and never reported \(1 of them abandoned"
    with pytest.raises(RuntimeError, match=message):
        llm.shutdown()


class RefusingThenFailingFlush(RefusingWorker):
    """Refuse the first plan with stores; the flush that follows the refusal fails too."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker, has_stores, ValueError("rejected job"))
        self.failing_flushes = 0

    def submit(self, plan: TransferPlan) -> None:
        try:
            super().submit(plan)
        except ValueError:
            self.failing_flushes = 1
            raise

    def flush(self) -> None:
        if self.failing_flushes:
            self.failing_flushes -= 1
            raise RuntimeError("injected flush failure")
        self.worker.flush()


def refused_and_flush_failed(
    worker_type: type[RefusingThenFailingFlush],
) -> tuple[LLM, Callable[[], None], RefusingThenFailingFlush]:
    """Return an engine whose first plan with stores was refused and whose flush after
    the refusal failed (the `generate` that hit it raised), its `arm`, and the worker."""
    llm, arm = new_engine()
    assert llm.offload is not None
    worker = worker_type(llm.offload.worker)
    llm.offload.worker = worker
    with pytest.raises(RuntimeError, match="injected flush failure"):
        llm.generate(prompts(2, 24), PARAMS)
    assert worker.refused is not None
    return llm, arm, worker


def serve_the_whole_pool(llm: LLM, arm: Callable[[], None]) -> None:
    """Serve a prompt that needs all 19 usable GPU blocks (no block may stay pinned),
    check it against the reference and the books, and shut down."""
    long_prompt = prompts(1, 72, offset=9)
    arm()
    (output,) = llm.generate(long_prompt, PARAMS)
    assert [output.output_token_ids] == reference([long_prompt])[0]
    assert_consistent_and_drained(llm, arm)
    assert llm.offload is not None
    assert llm.offload.totals.num_failed_stores > 0
    llm.shutdown()


def test_a_refused_plan_whose_flush_fails_too_is_failed_by_the_next_flush() -> None:
    # Regression (found by a chaos driver): when the flush after a refused plan failed
    # too, the plan's events stayed in flight for good. Their stores pinned GPU blocks,
    # so a request needing the whole pool never fit, and `generate` stepped forever (no
    # error: something was in flight). Now the flush before the next plan is retried and
    # the events the worker never started are failed.
    llm, arm, _ = refused_and_flush_failed(RefusingThenFailingFlush)
    serve_the_whole_pool(llm, arm)


class InterruptedPollAfterFlush(RefusingThenFailingFlush):
    """Also interrupt (Ctrl-C) the first poll after the injected flush failure."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker)
        self.interrupt_poll = False

    def flush(self) -> None:
        try:
            super().flush()
        except RuntimeError:
            self.interrupt_poll = True
            raise

    def peek(self) -> Any:
        if self.interrupt_poll:
            self.interrupt_poll = False
            raise KeyboardInterrupt("Ctrl-C in poll")
        return self.worker.peek()


def test_an_interrupt_after_the_retried_flush_does_not_strand_the_refused_plan() -> None:
    # Regression: the retried flush succeeded, then a Ctrl-C landed in the poll that
    # sorts the refused plan's events. The flush was already marked done, so only a later
    # preemption retried it: until then the plan's stores stayed in flight, pinning GPU
    # blocks, and `drain()` (so `shutdown()`) raised that they would never complete.
    llm, arm, _ = refused_and_flush_failed(InterruptedPollAfterFlush)
    arm()
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C in poll"):
        llm.generate(prompts(1, 8, offset=40), PARAMS)
    arm()
    llm.drain()
    assert not llm.offload.has_pending_work()
    assert llm.offload.totals.num_failed_stores > 0
    serve_the_whole_pool(llm, arm)
