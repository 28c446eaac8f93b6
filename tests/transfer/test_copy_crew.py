"""A lane's copy crew: batches split over threads copy exactly the asked rows, errors
come back only once every share stopped, and the helper threads go away."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.transfer.copy_crew as copy_crew
from kvtier.transfer.block_copy import CopyStrategy, as_rows, plan_copy
from kvtier.transfer.copiers import CpuCopier, StagingRows
from kvtier.transfer.copy_crew import CopyCrew, RegionCopy, crew_size, share_out
from kvtier.transfer.lanes import TransferLane


def _helpers(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"kvtier-{name}-copy")]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5000)), max_size=6),
    parts=st.integers(1, 6),
)
def test_shares_cover_every_row_once_in_order_and_evenly(
    sizes: list[tuple[int, int]], parts: int
) -> None:
    """Shares, read in order, are every item's rows exactly once; none holds more than
    its fair part plus one row."""
    shares = share_out(sizes, parts)
    assert len(shares) == parts
    pieces = [piece for share in shares for piece in share]
    seen = dict.fromkeys(range(len(sizes)), 0)
    for item, a, b in pieces:
        assert a == seen[item], (item, a, b)
        assert a < b, (item, a, b)
        seen[item] = b
    assert seen == {item: rows for item, (rows, _) in enumerate(sizes)}
    assert [item for item, _, _ in pieces] == sorted(item for item, _, _ in pieces)
    total = sum(rows * row_bytes for rows, row_bytes in sizes)
    widest = max((row_bytes for _, row_bytes in sizes), default=0)
    for share in shares:
        held = sum((b - a) * sizes[item][1] for item, a, b in share)
        assert held <= total / parts + widest


@st.composite
def batches(
    draw: st.DrawFn,
) -> tuple[int, list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """Regions of a few widths, and ids whose plans take every strategy."""
    rows = draw(st.integers(1, 48))
    num = draw(st.integers(0, rows))
    pattern = draw(st.sampled_from(["scattered", "src run", "dst run"]))
    src_ids = np.array(draw(st.permutations(range(rows)))[:num], dtype=np.int64)
    dst_ids = np.array(draw(st.permutations(range(rows)))[:num], dtype=np.int64)
    if pattern == "src run":
        first = draw(st.integers(0, rows - num))
        src_ids = np.arange(first, first + num, dtype=np.int64)
    elif pattern == "dst run":
        first = draw(st.integers(0, rows - num))
        dst_ids = np.arange(first, first + num, dtype=np.int64)
    widths = draw(st.lists(st.sampled_from([1, 3, 16, 512, 9000]), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    regions = [
        (rng.integers(0, 2**62, (rows, w)), rng.integers(0, 2**62, (rows, w))) for w in widths
    ]
    return rows, regions, src_ids, dst_ids


@settings(max_examples=80, deadline=None)
@given(case=batches(), size=st.integers(1, 4))
def test_a_batch_split_over_threads_copies_exactly_the_asked_rows(
    case: tuple[int, list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray], size: int
) -> None:
    """Every strategy, shares cut anywhere (one byte per share is worth a hand-off here):
    each destination row holds its source row, every other row is untouched."""
    _, regions, src_ids, dst_ids = case
    crew = CopyCrew(size, "prop", min_share_bytes=1)
    try:
        expected = []
        copies = []
        for src, dst in regions:
            want = dst.copy()
            want[dst_ids] = src[src_ids]
            expected.append(want)
            plan = plan_copy(src_ids, dst_ids, src.shape[1] * 8)
            copies.append(RegionCopy(plan, src, dst))
        crew.run(copies)
        for (_, dst), want in zip(regions, expected, strict=True):
            assert np.array_equal(dst, want)
    finally:
        crew.close()


def test_every_strategy_is_split_across_the_crew(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 MiB batch over 3 threads: each strategy's rows are copied by all three."""
    ran: dict[CopyStrategy, set[str]] = {s: set() for s in CopyStrategy}
    copy_rows = copy_crew.copy_rows

    def spying(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        ran[plan.strategy].add(threading.current_thread().name)
        copy_rows(plan, src, dst, a, b, scratch)

    monkeypatch.setattr(copy_crew, "copy_rows", spying)
    rng = np.random.default_rng(1)
    crew = CopyCrew(3, "split")
    try:
        for row_bytes, src_ids, dst_ids in (
            (64 << 10, rng.permutation(128)[:64], np.arange(64)),  # one destination run
            (64 << 10, np.arange(64), rng.permutation(128)[:64]),  # one source run
            (4 << 10, rng.permutation(2048)[:1024], rng.permutation(2048)[:1024]),  # scratch
        ):
            width = row_bytes // 8
            src = rng.integers(0, 2**62, (2 * len(src_ids), width))
            dst = np.zeros_like(src)
            plan = plan_copy(src_ids, dst_ids, row_bytes)
            crew.run([RegionCopy(plan, src, dst)])
            assert np.array_equal(dst[dst_ids], src[src_ids])
    finally:
        crew.close()
    assert all(len(names) == 3 for names in ran.values()), ran


def test_a_failed_share_is_raised_only_once_every_share_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lane's own share fails at once while a helper's still copies: `run` waits for
    the helper before raising (a failed job must leave no copy running)."""
    helper_done = threading.Event()

    def copy_rows(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("kvtier-fail-copy"):
            time.sleep(0.2)
            helper_done.set()
        else:
            raise OSError("lane share failed")

    monkeypatch.setattr(copy_crew, "copy_rows", copy_rows)
    crew = CopyCrew(2, "fail", min_share_bytes=1)
    src = np.zeros((8, 4), dtype=np.int64)
    plan = plan_copy(np.arange(8), np.arange(8), 32)
    try:
        with pytest.raises(OSError, match="lane share failed"):
            crew.run([RegionCopy(plan, src, np.zeros_like(src))])
        assert helper_done.is_set()
    finally:
        crew.close()


def test_a_helper_share_error_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error on a helper thread is raised by `run`, and the helper lives on."""
    fail = [True]
    copy_rows = copy_crew.copy_rows

    def flaky(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        if fail[0] and threading.current_thread().name.startswith("kvtier-flaky-copy"):
            raise ValueError("helper share failed")
        copy_rows(plan, src, dst, a, b, scratch)

    monkeypatch.setattr(copy_crew, "copy_rows", flaky)
    crew = CopyCrew(2, "flaky", min_share_bytes=1)
    src = np.arange(64, dtype=np.int64).reshape(16, 4)
    plan = plan_copy(np.arange(16), np.arange(16), 32)
    try:
        with pytest.raises(ValueError, match="helper share failed"):
            crew.run([RegionCopy(plan, src, np.zeros_like(src))])
        fail[0] = False
        dst = np.zeros_like(src)
        crew.run([RegionCopy(plan, src, dst)])
        assert np.array_equal(dst, src)
    finally:
        crew.close()


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


def test_crew_size_follows_copy_threads_and_caps_the_default() -> None:
    """Set: as given; None: torch's intra-op count, at most MAX_DEFAULT_SIZE."""
    assert crew_size(3) == 3
    assert crew_size(None) == min(torch.get_num_threads(), copy_crew.MAX_DEFAULT_SIZE)
    with pytest.raises(ValueError, match="positive number of threads, got 0"):
        CopyCrew(0, "none")


def test_cpu_copier_checks_every_region_before_copying_any() -> None:
    """A bad second region (an id past its rows) copies nothing into the first."""
    crew = CopyCrew(1, "check")
    try:
        good_src, good_dst = (
            torch.ones(8, 4, dtype=torch.int64),
            torch.zeros(8, 4, dtype=torch.int64),
        )
        short_dst = torch.zeros(2, 4, dtype=torch.int64)
        with pytest.raises(ValueError, match=r"destination id 5 outside \[0, 2\)"):
            CpuCopier(crew).store(
                [good_src, good_src], np.array([0, 1]), [good_dst, short_dst], np.array([4, 5])
            )
        assert not good_dst.any()
    finally:
        crew.close()


def test_rows_of_a_dtype_numpy_lacks_are_seen_as_bytes() -> None:
    """bfloat16 rows (which numpy has no dtype for) are copied as their bytes."""
    rows = torch.randn(4, 6).to(torch.bfloat16)
    assert as_rows(rows).dtype == np.uint8
    assert as_rows(rows).shape == (4, 12)


def test_staging_copies_stay_on_the_lanes_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging copies feed a disk that one thread outpaces: no helper takes a share (they
    would take the cores of the disk tier's I/O threads), while a host copy is shared."""
    threads: list[str] = []
    copy_rows = copy_crew.copy_rows

    def spying(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        copy_rows(plan, src, dst, a, b, scratch)

    monkeypatch.setattr(copy_crew, "copy_rows", spying)
    crew = CopyCrew(3, "staging", min_share_bytes=1)
    try:
        copier = CpuCopier(crew)
        engine = [torch.randint(0, 2**62, (16, 64), dtype=torch.int64) for _ in range(2)]
        staging = StagingRows.of(torch.zeros(8, 128, dtype=torch.int64), [(0, 64), (64, 128)])
        blocks = np.array([9, 2, 14, 5, 7, 0, 11, 3])
        copier.store_to_staging(engine, blocks, staging)
        back = [torch.zeros_like(t) for t in engine]
        copier.load_from_staging(staging, back, blocks)
        assert set(threads) == {threading.current_thread().name}
        for original, copied in zip(engine, back, strict=True):
            assert torch.equal(copied[blocks], original[blocks])
        threads.clear()
        copier.store(engine, blocks, back, blocks)
        assert len(set(threads)) == 3
    finally:
        crew.close()


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
