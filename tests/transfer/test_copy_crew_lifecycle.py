"""A lane's copy crew, its threads: helpers start when first needed (or leave their
share to the lane's thread), stop on close, when the crew is dropped or the lane closes,
and never leave a batch waiting for good, at interpreter exit included."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.transfer.block_copy import plan_copy
from kvtier.transfer.copy_crew import CopyCrew, RegionCopy, share_out
from kvtier.transfer.lanes import TransferLane


def _helpers(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"kvtier-{name}-copy")]


def test_helpers_stop_on_close_and_when_the_crew_is_dropped() -> None:
    """`close()` joins the helpers; a crew dropped unclosed stops them too."""
    crew = CopyCrew(3, "closing")
    assert _helpers("closing") == []  # none until a batch needs them
    src = np.ones((64, 1 << 14), dtype=np.int64)  # 8 MiB: every helper gets a share
    crew.run([RegionCopy(plan_copy(np.arange(64), np.arange(64), 1 << 17), src, src * 0)])
    assert len(_helpers("closing")) == 2
    crew.close()
    crew.close()  # idempotent
    assert _helpers("closing") == []
    dropped = CopyCrew(3, "dropped")
    src = np.ones((64, 1 << 14), dtype=np.int64)  # 8 MiB: every helper gets a share
    dropped.run([RegionCopy(plan_copy(np.arange(64), np.arange(64), 1 << 17), src, src * 0)])
    threads = _helpers("dropped")
    assert len(threads) == 2
    del dropped
    gc.collect()
    for thread in threads:
        thread.join(timeout=5)
    assert not any(t.is_alive() for t in threads)


def test_a_lane_closes_its_crew() -> None:
    """The lane's helper threads end with the lane."""
    lane = TransferLane("lanecrew", copy_threads=3)
    assert lane.crew.size == 3
    src = np.ones((64, 1 << 14), dtype=np.int64)
    lane.crew.run([RegionCopy(plan_copy(np.arange(64), np.arange(64), 1 << 17), src, src * 0)])
    assert len(_helpers("lanecrew")) == 2
    # A worker dropped on one of them is released from another thread (no self-join).
    assert all(lane.is_own_thread(t) for t in _helpers("lanecrew"))
    assert not lane.is_own_thread(threading.current_thread())
    lane.close()
    assert _helpers("lanecrew") == []


def test_a_helper_that_cannot_start_leaves_its_share_to_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a helper that could not start failed the batch. Python 3.12 refuses
    every new thread once the interpreter exits, where `lanes._close_open_lanes` still
    runs the queued jobs: each CPU copy needing a helper not yet started failed. Its share
    is copied on the calling thread instead (never queued where no thread reads); a later
    batch starts the helper."""
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name.startswith("kvtier-limited-copy"):
            raise RuntimeError("can't create new thread at interpreter shutdown")
        start(thread)

    crew = CopyCrew(3, "limited", min_share_bytes=1)
    src = np.arange(96, dtype=np.int64).reshape(24, 4)
    plan = plan_copy(np.arange(24), np.arange(24), 32)
    dst = np.zeros_like(src)
    outcome: list[BaseException | None] = []

    def run_batch() -> None:
        try:
            crew.run([RegionCopy(plan, src, dst)])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        runner = threading.Thread(target=run_batch)
        start(runner)
        runner.join(timeout=10)
        assert not runner.is_alive(), "run() hung"
        assert outcome == [None]
        assert np.array_equal(dst, src)
        monkeypatch.setattr(threading.Thread, "start", start)
        dst[:] = 0
        crew.run([RegionCopy(plan, src, dst)])
        assert np.array_equal(dst, src)
        assert len(_helpers("limited")) == 2
    finally:
        crew.close()


def test_a_helper_first_needed_after_a_later_one_is_started_for_its_own_share() -> None:
    """Regression: helpers were started in hand-off order and counted by number. A batch
    whose middle share was empty (one large row, then a small one) started the helper for
    member 2 and counted it as member 1's, so the next batch queued member 1's share where
    no thread reads: run() hung."""
    crew = CopyCrew(3, "skipped", min_share_bytes=1)
    try:
        big, small = np.arange(100, dtype=np.int64)[None], np.arange(1, dtype=np.int64)[None]
        one_row = plan_copy(np.arange(1), np.arange(1), 8)
        first = [
            RegionCopy(one_row, big, np.zeros_like(big)),
            RegionCopy(one_row, small, small * 0),
        ]
        assert [bool(s) for s in share_out([(1, 800), (1, 8)], 3)] == [True, False, True]
        crew.run(first)
        src = np.arange(96, dtype=np.int64).reshape(12, 8)
        dst = np.zeros_like(src)
        plan = plan_copy(np.arange(12), np.arange(12), 64)
        runner = threading.Thread(
            target=crew.run, args=([RegionCopy(plan, src, dst)],), daemon=True
        )
        runner.start()
        runner.join(timeout=10)
        assert not runner.is_alive(), "run() hung on a share no helper reads"
        assert np.array_equal(dst, src)
        assert len(_helpers("skipped")) == 2
    finally:
        crew.close()


def test_a_batch_after_close_is_refused_not_left_hanging() -> None:
    """After `close()` no helper reads its queue: a batch that needed one would wait for
    good. It is refused (the lane never submits one after closing; this guards that)."""
    crew = CopyCrew(2, "closed", min_share_bytes=1)
    crew.close()
    src = np.arange(96, dtype=np.int64).reshape(12, 8)
    plan = plan_copy(np.arange(12), np.arange(12), 64)
    outcome: list[BaseException | None] = []

    def run_batch() -> None:
        try:
            crew.run([RegionCopy(plan, src, np.zeros_like(src))])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run_batch, daemon=True)
    runner.start()
    runner.join(timeout=10)
    assert not runner.is_alive(), "run() after close() hung"
    assert isinstance(outcome[0], RuntimeError)
    assert "copy crew closed is closed" in str(outcome[0])


_EXIT_SCRIPT = """
import atexit, sys, time, weakref
import numpy as np
from kvtier.transfer.block_copy import plan_copy
from kvtier.transfer.copy_crew import RegionCopy
from kvtier.transfer.lanes import TransferLane

lane = TransferLane("atexit", copy_threads=2)
src = np.ones((64, 1 << 14), dtype=np.int64)  # 8 MiB: the helper gets a share
dst = np.zeros_like(src)
plan = plan_copy(np.arange(64), np.arange(64), 1 << 17)

def job():
    time.sleep(0.5)  # still queued when the interpreter starts to exit
    lane.crew.run([RegionCopy(plan, src, dst)])
    with open(sys.argv[1], "w") as out:
        out.write(str(int(dst.sum())))

lane.submit(1, lambda: job() or None)
lane.submit(2, lambda: job() or None)
# Finalizers' exit hook last registered, so first to run: before the lanes' own.
atexit.unregister(weakref.finalize._exitfunc)
atexit.register(weakref.finalize._exitfunc)
"""


def test_jobs_run_at_exit_still_have_their_crew(tmp_path: Path) -> None:
    """Lanes finish their queued jobs at interpreter exit. Had the crew's finalizer run
    at exit first (its order only depends on what registered its hook first), it would
    have stopped the helpers, and the job handing them a share would wait for good."""
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    result = tmp_path / "copied"
    subprocess.run([sys.executable, str(script), str(result)], check=True, timeout=60)
    assert result.read_text() == str(64 << 14)
