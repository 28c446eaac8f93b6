"""Ctrl-C (SIGINT) while the engine builds a step's transfer plan (`OffloadSide.prepare`).

Regression: a KeyboardInterrupt inside `OffloadScheduler.build_plan` stranded what the
build had taken or issued. Cut short after the queued stores or loads were taken, before
their event was issued, their tier slots stayed referenced with no pin
(`check_invariants`: "CPU block 1: ref 1, pins 0"); cut short after an event was issued,
before the plan was recorded, no worker ever saw the event: the next `generate` stepped
forever, or `shutdown` could not drain ("1 store or demotion events issued and never
reported").

Now the engine holds SIGINT over the build until the plan is recorded
(`SigintDeferral`), and delivers it then to the handler that was in place; the plan,
never submitted, is failed by the next `prepare`. The tests raise the signal by calling
whatever SIGINT handler is installed at each line of the build (as Python would), or
send a real SIGINT from inside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from functools import partial
from itertools import count
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
from step_watchdog import with_watchdog
from test_llm_submit_failures import (
    MAX_STEPS,
    PARAMS,
    assert_consistent_and_drained,
    new_engine,
    reference,
)

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.offload.plan_assembly import PlanAssembler
from kvtier.offload.scheduler import OffloadScheduler

# A small pool: the second prompt evicts the first one's blocks, so the third call loads
# them back from the CPU tier. Ten steps, with stores, a load and steps planning nothing.
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=8, max_num_batched_tokens=32)
FIRST = [(3 * j) % 128 for j in range(16)]
CALLS = [[FIRST], [[(5 * j + 1) % 128 for j in range(24)]], [[*FIRST, 1, 2, 3, 4]]]
# Where a signal is sent from in the build: as a call of the method named returns
# (`_store_records` is called once the stores are taken). Demotions: cascades only.
POINTS = {
    "stores taken": "_store_records",
    "loads taken": "take_queued",
    "event issued": "issue",
    "demotions taken": "take_queued",
}
MAX_CALLS = 5  # tries of each call or drain: each signal fails one
BUILD_CODES = (
    OffloadScheduler.build_plan.__code__,
    *(f.__code__ for f in vars(PlanAssembler).values() if hasattr(f, "__code__")),
)


def serve(llm: LLM, arm: Callable[[], None]) -> list[Any]:
    """Run `CALLS` in order, each again while interrupted; return their tokens. Each
    call's stores are drained before the next call (the third one's tier hit is sure)."""
    served = []
    for call in CALLS:
        served.append(retried(partial(tokens, llm, call), arm))
        retried(llm.drain, arm)
    return served


def tokens(llm: LLM, call: list[list[int]]) -> list[Any]:
    return [o.output_token_ids for o in llm.generate(call, PARAMS)]


def run_calls(llm: LLM) -> None:
    """Run `CALLS` in order, each call's stores drained before the next."""
    for call in CALLS:
        tokens(llm, call)
        llm.drain()


def retried(run: Callable[[], Any], arm: Callable[[], None]) -> Any:
    """Return what `run` returns, called again while interrupted."""
    for _ in range(MAX_CALLS):
        arm()
        try:
            return run()
        except KeyboardInterrupt:
            continue
    raise AssertionError("every try was interrupted")


def assert_works(llm: LLM, arm: Callable[[], None], expected: list[Any]) -> None:
    """Check the pools and pins, the drain, the tokens of a second run and the shutdown."""
    assert_consistent_and_drained(llm, arm)
    assert llm.offload is not None
    llm.offload.worker.check_invariants()
    assert serve(llm, arm) == expected  # tier hits of the run before included
    arm()
    llm.shutdown()


class LineSignal:
    """A tracer that calls the SIGINT handler installed then, as Python would for a
    Ctrl-C (once), at the first run of the `n`th distinct line of `codes`, a line being
    distinct also by what its frame holds (`holding`): every line of a plan with no
    job, with stores taken, with loads taken, with a job issued..."""

    def __init__(self, n: int, codes: tuple[CodeType, ...]) -> None:
        self.n, self.codes = n, codes
        self.seen: set[tuple[Any, ...]] = set()
        self.landed: tuple[Any, ...] | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self.line if frame.f_code in self.codes and self.landed is None else None

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "line" or self.landed is not None:
            return self.line
        where = (frame.f_code.co_name, frame.f_lineno, *holding(frame))
        if where not in self.seen:
            self.seen.add(where)
            if len(self.seen) == self.n:
                self.landed = where
                handler = signal.getsignal(signal.SIGINT)
                assert callable(handler)
                handler(signal.SIGINT, frame)
        return self.line


def holding(frame: FrameType) -> tuple[bool, bool, int]:
    """Return whether the build (or `_issue`) took stores and loads, and its jobs so far."""
    local = frame.f_locals
    return bool(local.get("stores")), bool(local.get("loads")), len(local.get("jobs") or ())


def test_a_signal_at_any_line_of_the_plan_build_leaves_the_engine_working() -> None:
    expected = reference(CALLS, ENGINE)
    landed = []
    for n in count(1):
        llm, arm = new_engine(ENGINE)
        tracer = LineSignal(n, BUILD_CODES)
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            served = serve(llm, arm)
        except AssertionError as exc:
            raise AssertionError(f"signal at {tracer.landed}: {exc}") from exc
        finally:
            sys.settrace(previous)
        if tracer.landed is None:  # past the last line
            llm.shutdown()
            break
        landed.append(tracer.landed)
        try:
            assert served == expected
            assert_works(llm, arm, expected)
        except (AssertionError, RuntimeError) as exc:
            raise AssertionError(f"signal at {tracer.landed}: {exc}") from exc
    # Lines with stores taken, before and after their event was issued; with loads taken.
    assert {(True, False, 0), (True, False, 1), (False, True, 0)} <= {w[2:] for w in landed}
    assert len(landed) > 40, landed


def signal_after(llm: LLM, point: str, send: Callable[[], None]) -> list[str]:
    """Make the offload scheduler's plan build call `send` (once) at `point` (one of
    `POINTS`); return a list that says "sent" once it was called, and "built" after
    each plan built."""
    assert llm.offload is not None
    scheduler = llm.offload.scheduler
    owners = {
        "stores taken": scheduler._plans,
        "loads taken": scheduler.loads,
        "demotions taken": scheduler.cascade,
    }
    owner, name = owners.get(point, scheduler._book), POINTS[point]
    method, build_plan = getattr(owner, name), scheduler.build_plan
    events: list[str] = []

    def sending(*args: Any) -> Any:
        result = method(*args)
        if "sent" not in events and (result or name != "take_queued"):
            events.append("sent")
            send()
        return result

    def building(step: Any) -> Any:
        plan = build_plan(step)
        events.append("built")
        return plan

    setattr(owner, name, sending)
    scheduler.build_plan = building  # type: ignore[method-assign]
    return events


def kill() -> None:
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("point", list(POINTS))
def test_a_real_sigint_in_the_build_interrupts_generate_after_it(
    point: str, tmp_path: Path
) -> None:
    expected = reference(CALLS, ENGINE)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's; put back after
    if point == "demotions taken":  # from the CPU tier to the disk tier (write-back)
        llm, arm = cascade_engine(tmp_path)
    else:
        llm, arm = new_engine(ENGINE)
    events = signal_after(llm, point, kill)
    with pytest.raises(KeyboardInterrupt):
        run_calls(llm)
    built = events[events.index("sent") :]
    assert_works(llm, arm, expected)
    assert built == ["sent", "built"]  # the build ran to its end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def cascade_engine(disk_path: Path) -> tuple[LLM, Callable[[], None]]:
    """Return an engine whose CPU tier (8 blocks) demotes to a disk tier as it fills,
    and a function arming its step watchdog."""
    block_bytes = ModelConfig.tiny().kv_bytes_per_token() * ENGINE.block_size
    config = OffloadConfig(
        cpu_bytes=8 * block_bytes,
        disk_bytes=32 * block_bytes,
        disk_path=str(disk_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        cascade=CascadeMode.WRITE_BACK,
    )
    llm = LLM(None, kv_offload=config, engine=ENGINE)
    arm = with_watchdog(llm, MAX_STEPS)
    arm()
    return llm, arm


def test_a_sigint_handler_of_the_program_is_called_once_after_the_build() -> None:
    expected = reference(CALLS, ENGINE)
    llm, arm = new_engine(ENGINE)
    events = signal_after(llm, "stores taken", kill)

    def handler(signum: int, frame: FrameType | None) -> None:
        events.append("handled")

    signal.signal(signal.SIGINT, handler)
    assert serve(llm, arm) == expected  # not interrupted
    assert events.count("handled") == 1
    assert events.index("handled") == events.index("sent") + 2  # after the plan's build
    assert signal.getsignal(signal.SIGINT) is handler
    assert_works(llm, arm, expected)


def test_an_ignored_sigint_stays_ignored_in_the_build() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    llm, arm = new_engine(ENGINE)
    during: list[Any] = []

    def note_and_kill() -> None:
        during.append(signal.getsignal(signal.SIGINT))
        kill()

    signal_after(llm, "stores taken", note_and_kill)
    assert serve(llm, arm) == reference(CALLS, ENGINE)  # not interrupted
    assert during == [signal.SIG_IGN]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    llm.shutdown()


def test_a_sigint_held_under_the_default_action_ends_the_process_after_the_block() -> None:
    code = (
        "import os, signal\n"
        "from kvtier.engine.sigint_deferral import SigintDeferral\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        "with SigintDeferral():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('held', flush=True)\n"
        "print('not ended', flush=True)\n"
    )
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (-signal.SIGINT, "held\n"), done.stderr


def test_outside_the_main_thread_the_handler_is_left_alone() -> None:
    # `signal.signal` raises ValueError there; no thread but the main one runs handlers.
    llm, arm = new_engine(ENGINE)
    handler = signal.getsignal(signal.SIGINT)
    during: list[Any] = []
    signal_after(llm, "stores taken", lambda: during.append(signal.getsignal(signal.SIGINT)))
    served: list[Any] = []
    thread = threading.Thread(target=lambda: served.append(serve(llm, arm)))
    thread.start()
    thread.join()
    assert served == [reference(CALLS, ENGINE)]
    assert during == [handler]
    llm.shutdown()
