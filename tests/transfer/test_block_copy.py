"""Batched whole-block copies on the CPU: every strategy copies exactly the asked rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transfer_helpers import random_rows, reference_copy

from example_counts import scaled_examples
from kvtier.transfer.block_copy import (
    CopyStrategy,
    copy_blocks,
    new_scratch,
    plan_copy,
    row_dtype,
    runs_of,
)


@st.composite
def copy_cases(draw: st.DrawFn) -> tuple[int, int, np.ndarray, np.ndarray]:
    rows = draw(st.integers(1, 40))
    width = draw(st.sampled_from([1, 12, 64, 4096, 70000]))
    num = draw(st.integers(0, rows))
    dst_ids = draw(st.permutations(range(rows)))[:num]
    if draw(st.booleans()):  # one run, as fresh tier slots and staging rows are
        first = draw(st.integers(0, rows - num))
        dst_ids = list(range(first, first + num))
    pattern = draw(st.sampled_from(["random", "sorted", "repeated", "one run"]))
    if pattern == "one run":
        first = draw(st.integers(0, rows - num))
        src_ids = list(range(first, first + num))
    elif pattern == "sorted":
        src_ids = sorted(draw(st.permutations(range(rows)))[:num])
    elif pattern == "repeated":
        src_ids = draw(st.lists(st.integers(0, rows - 1), min_size=num, max_size=num))
    else:
        src_ids = draw(st.permutations(range(rows)))[:num]
    return rows, width, np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64)


@settings(max_examples=scaled_examples(60), deadline=None)
@given(case=copy_cases(), use_scratch=st.booleans())
def test_copy_blocks_matches_row_by_row_copy(
    case: tuple[int, int, np.ndarray, np.ndarray], use_scratch: bool
) -> None:
    """Any ids (sorted, random, repeated sources, empty) give the row-by-row result."""
    rows, width, src_ids, dst_ids = case
    src = random_rows(rows, width, seed=1)
    dst = random_rows(rows, width, seed=2)
    expected = reference_copy(src, src_ids, dst, dst_ids)
    copy_blocks(src, src_ids, dst, dst_ids, new_scratch(width) if use_scratch else None)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("width", [8, 24, 4096])
def test_strided_destination_columns(width: int) -> None:
    """Copying into a column slice of a wider tensor (a staging buffer) leaves other columns."""
    src = random_rows(32, width, seed=3)
    staging = random_rows(8, width * 3, seed=4)
    before = staging.clone()
    src_ids = np.array([30, 2, 17, 5, 9], dtype=np.int64)
    rows = np.arange(5, dtype=np.int64)
    copy_blocks(src, src_ids, staging[:, width : 2 * width], rows)
    assert torch.equal(staging[:5, width : 2 * width], src[torch.from_numpy(src_ids)])
    assert torch.equal(staging[:, :width], before[:, :width])
    assert torch.equal(staging[5:], before[5:])
    back = torch.zeros_like(src)
    copy_blocks(staging[:, width : 2 * width], rows, back, src_ids)
    assert torch.equal(back[torch.from_numpy(src_ids)], src[torch.from_numpy(src_ids)])


def test_fragmented_small_rows_use_the_scratch_path() -> None:
    """Many short runs on both sides (the two-pass path) still copy correctly in chunks."""
    rows, width = 3000, 64
    src, dst = random_rows(rows, width, seed=5), random_rows(rows, width, seed=6)
    rng = np.random.default_rng(0)
    src_ids = rng.permutation(rows)[:2500].astype(np.int64)
    dst_ids = rng.permutation(rows)[:2500].astype(np.int64)
    expected = reference_copy(src, src_ids, dst, dst_ids)
    copy_blocks(src, src_ids, dst, dst_ids, np.zeros((7, width), dtype=np.uint8))
    assert torch.equal(dst, expected)


def test_ids_in_one_ascending_run_are_planned_without_sorting() -> None:
    """A side that counts up by one (fresh tier slots, staging rows) is one run as given:
    the other side's ids, unsorted, are the index, and the spans are exact."""
    plan = plan_copy(np.array([9, 3, 4]), np.arange(10, 13), 64)
    assert (plan.strategy, plan.runs) == (CopyStrategy.DST_RUNS, ((0, 3, 10),))
    assert plan.index.tolist() == [9, 3, 4]
    assert plan.run_starts == (0,)
    assert (plan.src_span, plan.dst_span) == ((3, 9), (10, 12))
    # Small rows, destinations scattered in many runs: the copy goes by source runs.
    dst_ids = np.array([40, 2, 31, 17, 8, 25])
    plan = plan_copy(np.arange(5, 11), dst_ids, 8)
    assert (plan.strategy, plan.runs) == (CopyStrategy.SRC_RUNS, ((0, 6, 5),))
    assert plan.index.tolist() == dst_ids.tolist()
    assert (plan.src_span, plan.dst_span) == ((5, 10), (2, 40))
    # Ends one run apart but out of order: sorted as before (index follows the sort).
    plan = plan_copy(np.array([0, 5, 2, 7]), np.array([10, 12, 11, 13]), 64)
    assert (plan.strategy, plan.runs) == (CopyStrategy.DST_RUNS, ((0, 4, 10),))
    assert plan.index.tolist() == [0, 2, 5, 7]


def test_the_side_in_fewer_runs_is_copied_by_runs() -> None:
    """Regression: a load from consecutive tier slots into scattered blocks went by
    destination runs (about one numpy call per block: 8 GB/s against 24 at 64 KiB
    blocks) because that side was tried first and its runs were long enough. The side
    that is one run, or in fewer runs, wins."""
    scattered = np.random.default_rng(0).permutation(2048)[:1024]
    plan = plan_copy(np.arange(1024), scattered, 64 << 10)
    assert (plan.strategy, plan.runs) == (CopyStrategy.SRC_RUNS, ((0, 1024, 0),))
    src_runs = np.concatenate([np.arange(0, 8), np.arange(100, 108)])
    plan = plan_copy(src_runs, scattered[:16], 64 << 10)
    assert plan.strategy is CopyStrategy.SRC_RUNS
    assert [(a, b) for a, b, _ in plan.runs] == [(0, 8), (8, 16)]


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [([5, 7, 7, 8], [3, 0, 6, 1]), ([6, 8, 7, 9], [2, 4, 0, 6]), ([4, 4], [1, 0])],
)
def test_ids_whose_ends_look_like_one_run_copy_exactly(
    src_ids: list[int], dst_ids: list[int]
) -> None:
    """Ids whose first and last are `len - 1` apart but repeat or go out of order are not
    taken for one run: every destination row gets its own source row."""
    src, dst = random_rows(10, 16, seed=7), random_rows(10, 16, seed=8)
    s, d = np.array(src_ids), np.array(dst_ids)
    expected = reference_copy(src, s, dst, d)
    copy_blocks(src, s, dst, d)
    assert torch.equal(dst, expected)


def test_runs_of_finds_consecutive_stretches() -> None:
    """Run starts plus the end sentinel."""
    assert runs_of(np.array([3, 4, 5, 9, 10, 20])).tolist() == [0, 3, 5, 6]
    assert runs_of(np.array([], dtype=np.int64)).tolist() == [0]


def test_row_dtype_is_int64_only_when_every_tensor_allows_it() -> None:
    """int64 rows need 8-byte widths, strides and offsets in every tensor."""
    a, b = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.uint8)
    assert row_dtype(a, b) == torch.int64
    odd = torch.zeros(4, 20, dtype=torch.uint8)[:, 4:16]  # 12-byte rows
    assert row_dtype(a, odd) == torch.uint8
    assert row_dtype(a, torch.zeros(4, 2)) == torch.uint8


def test_rejects_mismatched_rows_and_dtypes() -> None:
    """Row widths and dtypes must match."""
    ids = np.array([0], dtype=np.int64)
    with pytest.raises(ValueError, match="rows differ"):
        copy_blocks(
            torch.zeros(2, 8, dtype=torch.uint8), ids, torch.zeros(2, 16, dtype=torch.uint8), ids
        )
    with pytest.raises(ValueError, match="rows differ"):
        copy_blocks(torch.zeros(2, 8, dtype=torch.uint8), ids, torch.zeros(2, 8), ids)


@pytest.mark.parametrize(
    ("src_id", "dst_id", "message"),
    [
        (3, 9, r"destination id 9 outside \[0, 4\)"),
        (3, 4, r"destination id 4 outside \[0, 4\)"),
        (8, 1, r"source id 8 outside \[0, 8\)"),
        (3, -1, r"destination id -1 outside \[0, 4\)"),
        (100, 1, r"source id 100 outside \[0, 8\)"),
        (-20, 0, r"source id -20 outside \[0, 8\)"),
    ],
)
def test_rejects_ids_outside_the_rows(src_id: int, dst_id: int, message: str) -> None:
    """Regression: destination id 9 of 4 rows silently reallocated `dst`'s storage. The
    first id past the end is refused too."""
    src = random_rows(8, 16, seed=3)
    dst = torch.zeros(4, 16, dtype=torch.uint8)
    ptr, nbytes = dst.data_ptr(), dst.untyped_storage().nbytes()
    with pytest.raises(ValueError, match=message):
        copy_blocks(src, np.array([0, src_id]), dst, np.array([2, dst_id]))
    assert (dst.data_ptr(), dst.untyped_storage().nbytes()) == (ptr, nbytes)
    assert not dst.any(), "nothing is copied when an id is out of range"


@pytest.mark.parametrize(("num_src", "num_dst"), [(3, 1), (1, 3), (4, 2)])
def test_rejects_id_lists_of_different_lengths(num_src: int, num_dst: int) -> None:
    """Regression: 3 source ids for 1 destination id copied one row and returned as if
    done; 1 for 3 failed with numpy's IndexError. Both now name the counts, copy nothing."""
    src = random_rows(8, 16, seed=5)
    dst = torch.zeros(8, 16, dtype=torch.uint8)
    message = f"{num_src} source ids but {num_dst} destination ids"
    with pytest.raises(ValueError, match=message):
        copy_blocks(src, np.arange(num_src), dst, np.arange(4, 4 + num_dst))
    assert not dst.any(), "nothing is copied when the id lists differ in length"


def test_a_source_row_copied_twice_is_never_read_as_a_run() -> None:
    """One source row copied into two destination rows (a slot loaded into two blocks):
    the repeated id does not extend a run of consecutive source rows, so each destination
    gets exactly its row (SPEC §7: a load never returns wrong bytes). Fragmented
    destinations with two source runs make the copy go by source runs."""
    src = random_rows(8, 16, seed=4)
    dst = torch.zeros(8, 16, dtype=torch.uint8)
    src_ids, dst_ids = np.array([5, 5, 6]), np.array([1, 3, 5])
    expected = reference_copy(src, src_ids, dst, dst_ids)
    copy_blocks(src, src_ids, dst, dst_ids)
    assert torch.equal(dst, expected)
    assert runs_of(np.array([5, 5, 6])).tolist() == [0, 1, 3]
