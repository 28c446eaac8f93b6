"""A lane's copy crew: batches split over threads copy exactly the asked rows, errors
come back only once every share stopped (the threads themselves:
test_copy_crew_lifecycle.py)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.transfer.copy_crew as copy_crew
from example_counts import scaled_examples
from kvtier.transfer.block_copy import CopyStrategy, as_rows, plan_copy
from kvtier.transfer.copiers import CpuCopier, StagingRows
from kvtier.transfer.copy_crew import CopyCrew, RegionCopy, crew_size, share_out


@settings(max_examples=scaled_examples(200), deadline=None)
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


@settings(max_examples=scaled_examples(80), deadline=None)
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


@pytest.mark.parametrize("lane_fails", [True, False])
def test_every_failed_share_is_told_the_first_raised_the_others_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, lane_fails: bool
) -> None:
    """Several shares of one batch fail (the lane's own and a helper's, or two helpers'):
    `run` raises the first in batch order and logs each other one with its traceback."""

    def copy_rows(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        name = threading.current_thread().name
        if name.startswith("kvtier-many-copy"):
            raise ValueError(f"share of {name} failed")
        if lane_fails:
            raise OSError("lane share failed")

    monkeypatch.setattr(copy_crew, "copy_rows", copy_rows)
    crew = CopyCrew(3, "many", min_share_bytes=1)
    src = np.zeros((12, 4), dtype=np.int64)
    plan = plan_copy(np.arange(12), np.arange(12), 32)
    try:
        with (
            caplog.at_level(logging.WARNING, logger=copy_crew.__name__),
            pytest.raises(OSError if lane_fails else ValueError) as raised,
        ):
            crew.run([RegionCopy(plan, src, np.zeros_like(src))])
    finally:
        crew.close()
    helpers = [f"share of kvtier-many-copy{m} failed" for m in (1, 2)]
    told = [str(r.exc_info[1]) for r in caplog.records if r.exc_info and r.exc_info[1]]
    if lane_fails:
        assert str(raised.value) == "lane share failed"
        assert told == helpers
    else:
        assert str(raised.value) == helpers[0]
        assert told == helpers[1:]
    assert all("copy crew many" in r.getMessage() for r in caplog.records)


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


def test_rows_of_a_dtype_numpy_lacks_are_seen_as_integers_of_its_size() -> None:
    """bfloat16 rows (which numpy has no dtype for) are copied as int16 rows, float8 rows
    as bytes: the same memory, strides kept."""
    rows = torch.randn(4, 12).to(torch.bfloat16)[:, ::2]
    seen = as_rows(rows)
    assert (seen.dtype, seen.shape, seen.strides) == (np.int16, (4, 6), (24, 4))
    assert seen.ctypes.data == rows.data_ptr()
    assert as_rows(torch.zeros(4, 6, dtype=torch.float8_e4m3fn)).dtype == np.uint8


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
