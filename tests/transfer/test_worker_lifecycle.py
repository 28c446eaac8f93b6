"""Worker lifecycle and ordering: submit, poll (FIFO), flush, need_flush, shutdown."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transfer_helpers import (
    FaultyIO,
    fill_random,
    job,
    kv_per_layer,
    make_worker,
    run_plan,
    take_finished,
)

import kvtier.transfer.lanes as lanes_module
from kvtier.offload.plan import Tier, TransferPlan
from kvtier.storage import DiskIOMode
from kvtier.transfer import OffloadWorker, WorkerConfig, WorkerState
from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.regions import TensorLayout

JOIN_S = 10

pytestmark = pytest.mark.timeout(60)


def disk_config(tmp_path: Path, **extra: Any) -> WorkerConfig:
    return WorkerConfig(
        cpu_num_slots=8,
        disk_num_slots=8,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        **extra,
    )


def wait_for_report(worker: OffloadWorker, deadline_s: float = JOIN_S) -> dict[int, int]:
    """Poll until something is reported (poll itself never blocks)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        report = worker.poll()
        if not report.is_empty:
            return {**report.done, **report.failed}
        time.sleep(0.01)
    raise AssertionError("nothing reported")


def test_poll_reports_fifo_per_direction() -> None:
    """Twenty interleaved stores and loads come back in submission order per lane."""
    kv = kv_per_layer(2, 64, (4, 2, 8))
    fill_random(kv, seed=1)
    with make_worker(WorkerConfig(cpu_num_slots=32), kv) as worker:
        jobs = []
        for i in range(10):
            jobs.append(job(100 + 2 * i, Tier.GPU, Tier.CPU, [i + 1], [i]))
            jobs.append(job(101 + 2 * i, Tier.CPU, Tier.GPU, [i + 10], [i + 40]))
        report = run_plan(worker, *jobs)
        order = list(report.done)
        assert [e for e in order if e % 2 == 0] == list(range(100, 120, 2))
        assert [e for e in order if e % 2 == 1] == list(range(101, 121, 2))
        assert set(report.done.values()) == {1}
        assert worker.poll().is_empty


class SlowCompletion:
    """A fake device completion that finishes when told."""

    def __init__(self) -> None:
        self.finished = threading.Event()

    def is_done(self) -> bool:
        return self.finished.is_set()

    def wait(self) -> None:
        assert self.finished.wait(JOIN_S)

    def elapsed_s(self) -> float:
        return 0.004  # the device time a CUDA completion measures


def test_lane_never_reports_past_an_unfinished_job() -> None:
    """Finished jobs behind one whose device work still runs wait their turn; a job that
    raises is reported failed and the thread carries on."""
    lane = TransferLane("test")
    slow = SlowCompletion()
    ran_last = threading.Event()

    def fail() -> None:
        raise OSError("boom")

    def last() -> None:
        ran_last.set()

    lane.submit(1, lambda: slow)
    lane.submit(2, lambda: None)
    lane.submit(3, fail)
    lane.submit(4, last)
    assert ran_last.wait(JOIN_S)  # every job function has returned or raised
    assert take_finished(lane) == ({}, {})
    slow.finished.set()
    lane.wait_all()
    done, failed = take_finished(lane)
    assert (list(done), list(failed)) == ([1, 2, 4], [3])
    assert done[1] == 0.004  # device work: its measured device time
    lane.close()
    lane.close()


class FailedWait:
    """A fake device completion whose `wait` raises (a device error) while `is_done` never
    raises: it says `done_later` once waited for."""

    def __init__(self, done_later: bool) -> None:
        self.done_later = done_later
        self.waited = False

    def is_done(self) -> bool:
        return self.waited and self.done_later

    def wait(self) -> None:
        self.waited = True
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def elapsed_s(self) -> float:
        return 0.004


@pytest.mark.parametrize("done_later", [False, True], ids=["never_done", "done_later"])
def test_a_job_whose_device_wait_raised_is_reported_failed_once(
    done_later: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: `wait_all` swallowed the error and `finished` asked `is_done`
    again: one that stayed False held the lane's head for good (this job and every later
    one never reported: the engine waited forever); one that turned True reported the
    failed copy done."""
    lane = TransferLane("test")
    lane.submit(1, lambda: FailedWait(done_later))
    lane.submit(2, lambda: None)
    lane.wait_all()
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.lanes"):
        done, failed = take_finished(lane)
    assert (list(done), list(failed)) == ([2], [1])
    assert take_finished(lane) == ({}, {})
    assert lane.num_pending == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "lane test: transfer event 1 failed: CUDA error: an illegal memory access was encountered"
    ]
    lane.close()


def test_a_synchronous_job_reports_the_time_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEC §6.10 Beyond (transfer time): a job without device work (CPU copies, disk
    I/O) is timed on the lane's thread, here by a clock only the job moves (a bound on
    the wall time it took would not hold for a lane thread kept off a busy core)."""
    now = [1.0]
    monkeypatch.setattr(lanes_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def job() -> None:
        now[0] += 0.25

    lane = TransferLane("test")
    lane.submit(1, job)
    lane.wait_all()
    done, failed = take_finished(lane)
    assert list(failed) == []
    assert done == {1: 0.25}
    lane.close()


def test_jobs_dropped_by_cancel_queued_are_reported_failed() -> None:
    """`cancel_queued` lets the running job finish and drops the queued ones, which are
    reported failed, never done (SPEC §7: a store that never ran must not be taken for
    data in its slots); the lane refuses new jobs."""
    lane = TransferLane("test")
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def running() -> None:
        started.set()
        assert release.wait(JOIN_S)
        ran.append(1)

    lane.submit(1, running)
    lane.submit(2, lambda: ran.append(2))
    assert started.wait(JOIN_S)
    lane.cancel_queued()
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(3, lambda: None)
    release.set()
    lane.close()
    assert ran == [1]
    done, failed = take_finished(lane)
    assert (list(done), list(failed)) == ([1], [2])


def test_copy_threads_bounds_only_the_lane_thread() -> None:
    """copy_threads=1 gives the lane's torch ops one thread; the caller's setting stays."""
    before = torch.get_num_threads()
    seen: list[int] = []
    lane = TransferLane("test", copy_threads=1)

    def record() -> None:
        seen.append(torch.get_num_threads())

    lane.submit(1, record)
    lane.wait_all()
    lane.close()
    assert seen == [1]
    assert torch.get_num_threads() == before


def test_submit_returns_while_io_is_blocked_and_flush_waits(tmp_path: Path) -> None:
    """submit() returns at once even when the disk hangs; flush() returns only after it."""
    io = FaultyIO()
    io.gate.clear()
    kv = kv_per_layer(2, 16)
    with make_worker(disk_config(tmp_path), kv, io) as worker:
        worker.submit(TransferPlan(1, jobs=(job(1, Tier.GPU, Tier.DISK, [1, 2], [0, 1]),)))
        assert worker.poll().is_empty
        flusher = threading.Thread(target=worker.flush)
        flusher.start()
        flusher.join(0.2)
        assert flusher.is_alive(), "flush returned while a write was still blocked"
        io.gate.set()
        flusher.join(JOIN_S)
        assert not flusher.is_alive()
        assert dict(worker.poll().done) == {1: 1}


def test_need_flush_finishes_earlier_transfers_before_new_ones(tmp_path: Path) -> None:
    """A plan with need_flush (preemption) blocks submit until outstanding jobs finished."""
    io = FaultyIO()
    io.gate.clear()
    kv = kv_per_layer(2, 16)
    with make_worker(disk_config(tmp_path), kv, io) as worker:
        worker.submit(TransferPlan(1, jobs=(job(1, Tier.GPU, Tier.DISK, [1], [0]),)))
        second = TransferPlan(2, jobs=(job(2, Tier.GPU, Tier.CPU, [2], [0]),), need_flush=True)
        submitter = threading.Thread(target=worker.submit, args=(second,))
        submitter.start()
        submitter.join(0.2)
        assert submitter.is_alive(), "need_flush did not wait for the blocked store"
        io.gate.set()
        submitter.join(JOIN_S)
        worker.flush()
        assert list(worker.poll().done) == [1, 2]


def test_shutdown_is_idempotent_and_removes_the_disk_file(tmp_path: Path) -> None:
    """Shutdown finishes work, removes the file, keeps finished events pollable."""
    worker = make_worker(disk_config(tmp_path), kv_per_layer(2, 16))
    path = worker.disk_path
    assert path is not None
    assert os.path.exists(path)
    worker.submit(TransferPlan(1, jobs=(job(7, Tier.GPU, Tier.DISK, [3], [2]),)))
    worker.shutdown()
    worker.shutdown()
    assert worker.state is WorkerState.SHUT_DOWN
    assert not os.path.exists(path)
    assert dict(worker.poll().done) == {7: 1}
    worker.check_invariants()
    with pytest.raises(RuntimeError, match="shut_down"):
        worker.submit(TransferPlan(2))
    OffloadWorker(WorkerConfig()).shutdown()  # never registered


def test_register_once_and_before_use() -> None:
    """submit/num_blocks before register, or a second register, raise RuntimeError."""
    worker = OffloadWorker(WorkerConfig(cpu_num_slots=2))
    worker.check_invariants()
    with pytest.raises(RuntimeError, match="created"):
        worker.submit(TransferPlan(1))
    with pytest.raises(RuntimeError, match="register"):
        _ = worker.num_blocks
    worker.register(kv_per_layer(1, 4), TensorLayout.KV_FIRST)
    with pytest.raises(RuntimeError, match="registered"):
        worker.register(kv_per_layer(1, 4), TensorLayout.KV_FIRST)
    worker.shutdown()


@pytest.mark.parametrize(
    ("bad_job", "message"),
    [
        (job(1, Tier.GPU, Tier.CPU, [99], [0]), r"GPU ids \[99\] outside \[0, 16\)"),
        (job(1, Tier.GPU, Tier.CPU, [1], [8]), r"CPU ids \[8\] outside"),
        (job(1, Tier.GPU, Tier.CPU, [1, 2], [3, 3]), "repeated destination ids"),
        (job(1, Tier.GPU, Tier.DISK, [1], [0]), "no DISK tier"),
        (job(1, Tier.CPU, Tier.GPU, [-1], [1]), r"CPU ids \[-1\]"),
    ],
)
def test_invalid_jobs_raise_before_anything_starts(bad_job: object, message: str) -> None:
    """Contract violations raise ValueError and the valid job of the same plan never runs."""
    with make_worker(WorkerConfig(cpu_num_slots=8), kv_per_layer(1, 16)) as worker:
        good = job(2, Tier.GPU, Tier.CPU, [1], [1])
        with pytest.raises(ValueError, match=message):
            worker.submit(TransferPlan(1, jobs=(good, bad_job)))  # type: ignore[arg-type]
        worker.flush()
        assert worker.poll().is_empty
        worker.check_invariants()


def test_event_ids_in_flight_cannot_repeat() -> None:
    """An event id still in flight (or twice in one plan) is a scheduler bug."""
    with make_worker(WorkerConfig(cpu_num_slots=8), kv_per_layer(1, 16)) as worker:
        twice = (job(5, Tier.GPU, Tier.CPU, [1], [1]), job(5, Tier.GPU, Tier.CPU, [2], [2]))
        with pytest.raises(ValueError, match="event 5"):
            worker.submit(TransferPlan(1, jobs=twice))
        worker.submit(TransferPlan(1, jobs=twice[:1]))
        with pytest.raises(ValueError, match="event 5"):
            worker.submit(TransferPlan(2, jobs=twice[1:]))
        worker.flush()
        assert dict(worker.poll().done) == {5: 1}
        assert dict(run_plan(worker, twice[1]).done) == {5: 1}  # reported: reusable


def test_empty_job_and_empty_plan() -> None:
    """A job with no blocks is done at once; an empty plan reports nothing."""
    with make_worker(WorkerConfig(cpu_num_slots=2), kv_per_layer(1, 4)) as worker:
        assert run_plan(worker).is_empty
        assert dict(run_plan(worker, job(3, Tier.GPU, Tier.CPU, [], [])).done) == {3: 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cpu_num_slots": -1}, "cpu_num_slots"),
        ({"rank": True}, "rank"),
        ({"disk_num_slots": 4}, "needs a disk_path"),
        ({"disk_buffer_slots": 0}, "disk_buffer_slots"),
        ({"disk_io_mode": "direct"}, "DiskIOMode"),
        ({"copy_threads": 0}, "copy_threads"),
        (
            {"disk_batch_bytes": 2 << 30},
            r"disk_batch_bytes must be at most 2147479552 .*2147483648",
        ),
        ({"disk_path": b"/tmp/x"}, r"disk_path must be a str, got b'/tmp/x'"),
    ],
)
def test_worker_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    """Each invalid WorkerConfig value raises ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**kwargs)  # type: ignore[arg-type]
