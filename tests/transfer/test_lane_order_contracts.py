"""A lane's reports stay FIFO while its head is unfinished, time what ran, and a closed
lane takes no job (s33 mutation run on `transfer/lanes.py`: each test failed on a
mutant that passed every older test)."""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
from transfer_helpers import GATE_TIMEOUT_S

from kvtier.transfer.lanes import TransferLane

pytestmark = pytest.mark.timeout(60)


class Completion:
    """Device work that finishes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def is_done(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.done = True

    def elapsed_s(self) -> None:
        return None


def test_a_running_head_holds_back_the_cancelled_jobs_behind_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Jobs dropped by `cancel_queued` are done (cancelled) while the head still runs:
    they are reported after it, never before (reports are FIFO per lane)."""
    lane = TransferLane("fifo-cancel")
    gate, started = threading.Event(), threading.Event()

    def head() -> None:
        started.set()
        gate.wait(GATE_TIMEOUT_S)

    lane.submit(1, head)
    lane.submit(2, lambda: None)
    lane.submit(3, lambda: None)
    assert started.wait(GATE_TIMEOUT_S)
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.lanes"):
        lane.cancel_queued()
        assert lane.finished() == ({}, {})
        gate.set()
        lane.close()
        done, failed = lane.finished()
    assert list(done) == [1]
    assert list(failed) == [2, 3]


def test_a_head_whose_device_work_runs_holds_back_the_jobs_behind_it() -> None:
    """A job whose function returned while its device copies still run is not finished:
    the done job behind it waits for it in the reports."""
    lane = TransferLane("fifo-device")
    work = Completion()
    third_ran = threading.Event()
    lane.submit(1, lambda: work)
    lane.submit(2, lambda: None)
    lane.submit(3, third_ran.set)  # once it runs, job 2 is settled
    assert third_ran.wait(GATE_TIMEOUT_S)
    assert lane.finished() == ({}, {})
    lane.wait_all()  # waits for the device work of job 1
    assert list(lane.finished()[0]) == [1, 2, 3]
    lane.close()


def test_a_job_without_device_work_is_timed_by_its_run() -> None:
    """A job that copied synchronously reports the time its function ran."""
    lane = TransferLane("timed")
    lane.submit(1, lambda: time.sleep(0.05))
    lane.wait_all()
    done, _ = lane.finished()
    assert 0.05 <= done[1] < GATE_TIMEOUT_S
    lane.close()


def test_a_closed_lane_refuses_jobs() -> None:
    """A job queued behind the lane's stop would never run, and `wait_all` would wait
    for it for good."""
    lane = TransferLane("closed")
    lane.close()
    with pytest.raises(RuntimeError, match="lane closed is closed"):
        lane.submit(1, lambda: None)
    cancelled = TransferLane("cancelled")
    cancelled.cancel_queued()
    with pytest.raises(RuntimeError, match="lane cancelled is closed"):
        cancelled.submit(1, lambda: None)
    cancelled.close()


def test_a_lane_dropped_unclosed_stops_its_thread() -> None:
    """The thread holds the queue, not the lane: a lane garbage-collected without
    `close()` is stopped by its finalizer, not left blocked until the interpreter exits."""
    lane = TransferLane("dropped")
    lane.submit(1, lambda: None)
    lane.wait_all()
    thread = lane._thread
    del lane
    gc.collect()
    thread.join(GATE_TIMEOUT_S)
    assert not thread.is_alive()
