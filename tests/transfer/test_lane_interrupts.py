"""A transfer lane interrupted while it hands a job to its thread (KeyboardInterrupt).

Whatever the interrupt hits, every job the lane was given is either run and waited for by
`wait_all`, or never run and reported failed: a failed report must never leave a copy
running (a failed load's destination blocks go back to the engine at once).
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from types import FrameType
from typing import Any

import pytest
from transfer_helpers import (
    block_bytes,
    fill_random,
    job,
    kv_per_layer,
    make_worker,
    run_plan,
    take_finished,
)

import kvtier.transfer.lanes as lanes_module
import kvtier.transfer.worker as worker_module
from kvtier.offload.plan import Tier, TransferPlan
from kvtier.transfer import WorkerConfig
from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.routes import Direction

pytestmark = pytest.mark.timeout(60)


class SlowJob:
    """A job that copies for `seconds` and records that it ran to the end."""

    def __init__(self, seconds: float = 0.3) -> None:
        self.seconds = seconds
        self.started = threading.Event()
        self.finished = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        time.sleep(self.seconds)
        self.finished.set()


class InterruptingHandOff:
    """Stands in for a lane's job queue for one hand-off: `put` raises KeyboardInterrupt
    before or after the real queue took the job (a Ctrl-C landing in `submit` around
    the hand-off); with `once_started`, only once the lane's thread has started the job.
    The lane's own queue is back in place from the first `put` on."""

    def __init__(self, lane: TransferLane, after_queuing: bool, once_started: bool) -> None:
        self.lane = lane
        self.real = lane._jobs
        self.after_queuing = after_queuing
        self.once_started = once_started

    def put(self, item: Any) -> None:
        self.lane._jobs = self.real
        if self.after_queuing:
            self.real.put(item)
            lane = self.lane
            deadline = time.monotonic() + 10
            future = lane._pending[-1].future if self.once_started and lane._pending else None
            while future is not None and not (future.running() or future.done()):
                assert time.monotonic() < deadline, "the lane never started the job"
                time.sleep(0.001)
        raise KeyboardInterrupt


def interrupt_hand_off(lane: TransferLane, after_queuing: bool, once_started: bool = False) -> None:
    """Make the lane's next hand-off raise KeyboardInterrupt (`InterruptingHandOff`)."""
    lane._jobs = InterruptingHandOff(lane, after_queuing, once_started)  # type: ignore[assignment]


def take_all(lane: TransferLane) -> tuple[dict[int, float], dict[int, BaseException]]:
    lane.wait_all()
    return take_finished(lane)


def test_a_job_queued_before_the_interrupt_is_waited_for_and_reported() -> None:
    """Regression (of a thread pool's hand-off): the lane recorded the pool's future only
    after `submit` returned, so a job queued just before the interrupt ran unknown to the
    lane: `wait_all` returned at once while it still copied, and it was never reported."""
    lane = TransferLane("test")
    job = SlowJob()
    interrupt_hand_off(lane, after_queuing=True, once_started=True)
    with pytest.raises(KeyboardInterrupt):
        lane.submit(7, job)
    done, failed = take_all(lane)
    assert job.finished.is_set(), "wait_all returned while the job was still copying"
    assert (list(done), list(failed)) == ([7], [])
    lane.close()


def test_a_job_interrupted_before_it_was_queued_never_runs_and_is_reported_failed() -> None:
    lane = TransferLane("test")
    job = SlowJob()
    interrupt_hand_off(lane, after_queuing=False)
    with pytest.raises(KeyboardInterrupt):
        lane.submit(7, job)
    done, failed = take_all(lane)
    assert (done, list(failed)) == ({}, [7])
    lane.submit(8, SlowJob(0.0))  # the lane works on
    assert list(take_all(lane)[0]) == [8]
    lane.close()
    assert not job.started.is_set()


def test_cancel_queued_drops_the_waiting_jobs_and_waits_for_none_of_them() -> None:
    lane = TransferLane("test")
    running, queued = SlowJob(), SlowJob()
    lane.submit(1, running)
    assert running.started.wait(10)
    lane.submit(2, queued)
    lane.cancel_queued()
    done, failed = take_all(lane)  # waits for the running job only
    assert running.finished.is_set()
    assert (list(done), list(failed)) == ([1], [2])
    lane.close()
    assert not queued.started.is_set()


def test_a_lane_whose_thread_cannot_start_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lane's thread initializer raising: the lane is refused when it is made,
    naming the cause, rather than failing every job later."""

    def refuse(num_threads: int) -> bool:
        raise OSError(f"cannot limit the copy threads to {num_threads}")

    monkeypatch.setattr(lanes_module, "limit_intra_op_threads", refuse)
    with pytest.raises(RuntimeError, match="lane test: its thread failed to start"):
        TransferLane("test", copy_threads=1)


def lane_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"kvtier-{name}"]


def test_the_lanes_thread_runs_before_the_first_submit() -> None:
    """`submit` never starts a thread (an interrupt during a thread start could leave a
    running thread unrecorded, and the next submit would start a second one)."""
    lane = TransferLane("first-submit")
    threads = lane_threads("first-submit")
    assert threads == [lane._thread]
    assert threads[0].is_alive()
    lane.submit(1, SlowJob(0.0))
    assert lane_threads("first-submit") == threads
    assert list(take_all(lane)[0]) == [1]
    lane.close()
    assert not threads[0].is_alive()


class CallInterrupt:
    """A tracer raising KeyboardInterrupt at the `n`th Python function call (any depth)
    made while it traces (once; then it stops tracing), as a SIGINT handler run there
    would."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.landed: str | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and self.landed is None:
            self.n -= 1
            if self.n == 0:
                sys.settrace(None)
                self.landed = f"{frame.f_code.co_filename}:{frame.f_code.co_name}"
                raise KeyboardInterrupt(f"Ctrl-C entering {self.landed}")
        return None


def test_a_submit_interrupted_at_any_call_leaves_the_lane_working() -> None:
    """Regression: a Ctrl-C inside `ThreadPoolExecutor.submit` (in its idle semaphore's
    `acquire`) left the semaphore's lock held: the lane's thread blocked for good after
    its job, and every later `submit`, `wait_all` and `close` hung. Now the interrupt
    may land anywhere in `submit` and the lane still reports every job once (done or
    failed), takes new ones and closes."""
    for n in itertools.count(1):
        lane = TransferLane("any-call")
        lane.submit(1, SlowJob(0.0))  # the thread has run a job and waits for the next
        lane.wait_all()
        second = SlowJob(0.0)
        tracer = CallInterrupt(n)
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            lane.submit(2, second)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(previous)
        outcome: list[Any] = []

        def recover(lane: TransferLane = lane, outcome: list[Any] = outcome) -> None:
            outcome.append(take_all(lane))
            lane.submit(3, SlowJob(0.0))
            outcome.append(take_all(lane))
            lane.close()

        helper = threading.Thread(target=recover, daemon=True)
        helper.start()
        helper.join(10)
        where = f"interrupted entering {tracer.landed}"
        assert not helper.is_alive(), f"the lane hung, {where}"
        (done, failed), (later, _) = outcome
        assert list(done)[:1] == [1], where
        # Job 2 ran to the end and is reported done, or never ran and is reported failed
        # or (cut short before the lane recorded it) not at all.
        assert (2 in done) == second.finished.is_set(), where
        assert (2 in done or 2 in failed) or not second.started.is_set(), where
        assert list(later) == [3], where
        if tracer.landed is None:
            assert list(done) == [1, 2]
            break


@pytest.mark.parametrize("after_queuing", [True, False])
def test_a_worker_submit_interrupted_in_its_lane_keeps_its_books(after_queuing: bool) -> None:
    """Through `OffloadWorker`: the store is either copied, waited for by `flush` and
    reported done with the right bytes, or reported failed; the worker's in-flight
    events agree with its lanes either way."""
    kv = kv_per_layer(2, 8, (4, 2, 8))
    fill_random(kv, seed=1)
    worker = make_worker(WorkerConfig(cpu_num_slots=4), kv)
    image = block_bytes(worker.regions, 2)
    interrupt_hand_off(worker._lanes[Direction.STORE], after_queuing, once_started=True)
    with pytest.raises(KeyboardInterrupt):
        worker.submit(TransferPlan(step_id=0, jobs=(job(1, Tier.GPU, Tier.CPU, [2], [0]),)))
    worker.check_invariants()
    worker.flush()
    report = worker.poll()
    worker.check_invariants()
    if after_queuing:
        assert (dict(report.done), dict(report.failed)) == ({1: 1}, {})
        fill_random(kv, seed=2)
        assert run_plan(worker, job(2, Tier.CPU, Tier.GPU, [0], [3])).done == {2: 1}
        assert block_bytes(worker.regions, 3) == image
    else:
        assert (dict(report.done), dict(report.failed)) == ({}, {1: 1})
    worker.shutdown()


class GatedJob:
    """A job that holds the lane's thread until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        assert self.release.wait(30)


@pytest.mark.parametrize("then_cancel_queued", [False, True])
def test_a_job_cancelled_by_an_interrupt_logs_nothing_critical(
    then_cancel_queued: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the interrupted `submit` both cancelled and notified the job's future,
    so the thread's later `_run` of it (or `cancel_queued` cancelling it again) found it
    notified, and concurrent.futures logged 'Future ... in unexpected state' as CRITICAL
    for a job dropped as intended."""
    lane = TransferLane("test")
    gate, dropped = GatedJob(), SlowJob(0.0)
    lane.submit(1, gate)
    assert gate.started.wait(10)
    interrupt_hand_off(lane, after_queuing=True)  # queued behind the running job
    with pytest.raises(KeyboardInterrupt):
        lane.submit(2, dropped)
    if then_cancel_queued:
        lane.cancel_queued()
    gate.release.set()
    if not then_cancel_queued:
        lane.submit(3, SlowJob(0.0))
    done, failed = take_all(lane)
    lane.close()  # the thread has dealt with job 2 once it stopped
    assert list(failed) == [2]
    assert not dropped.started.is_set()
    assert list(done) == ([1] if then_cancel_queued else [1, 3])
    critical = [r.getMessage() for r in caplog.records if r.levelno >= logging.CRITICAL]
    assert critical == []


class SubmitLineInterrupt:
    """A tracer raising KeyboardInterrupt at the `n`th line run in `OffloadWorker.submit`
    itself (once; then it stops tracing)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.landed: int | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code.co_filename != worker_module.__file__ or code.co_name != "submit":
            return None
        return self.line

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "line" or self.landed is not None:
            return self.line
        self.n -= 1
        if self.n == 0:
            sys.settrace(None)
            self.landed = frame.f_lineno
            raise KeyboardInterrupt(f"Ctrl-C at worker.py:{frame.f_lineno}")
        return self.line


def test_a_worker_submit_interrupted_at_any_line_keeps_its_books() -> None:
    """Regression: an interrupt between recording a job in flight and the `try` that
    undoes it when the lane never got the job left the event in flight for good: never
    reported, `check_invariants` failed from then on ("in-flight events disagree")."""
    kv = kv_per_layer(2, 8, (4, 2, 8))
    plan = TransferPlan(
        step_id=0,
        jobs=(job(1, Tier.GPU, Tier.CPU, [2], [0]), job(2, Tier.CPU, Tier.GPU, [1], [3])),
    )
    for n in itertools.count(1):
        worker = make_worker(WorkerConfig(cpu_num_slots=4), kv)
        tracer = SubmitLineInterrupt(n)
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            worker.submit(plan)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(previous)
        where = f"interrupted at worker.py:{tracer.landed}"
        worker.check_invariants()
        worker.flush()
        report = worker.poll()
        worker.check_invariants()
        assert worker._in_flight == set(), where
        assert not set(report.done) & set(report.failed), where
        worker.shutdown()
        if tracer.landed is None:
            assert set(report.done) == {1, 2}
            break
