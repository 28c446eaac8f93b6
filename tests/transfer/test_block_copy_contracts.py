"""`block_copy`'s smaller promises: which byte rows read as int64 words, the strategy a
plan picks, shares of a plan's rows, and the scratch a caller hands in.

Each test here was written against a mutant that passed every older test (s33 mutation
run on `transfer/block_copy.py`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transfer_helpers import random_rows, reference_copy

from kvtier.transfer import block_copy
from kvtier.transfer.block_copy import (
    SCRATCH_BYTES,
    CopyStrategy,
    as_rows,
    copy_blocks,
    copy_rows,
    new_scratch,
    plan_copy,
    row_dtype,
    run_copy,
)

# Byte rows that fail exactly one of the conditions for reading them as int64 words.
_NOT_WORD_ROWS = {
    "bytes not adjacent": lambda: random_rows(6, 32, 1)[:, ::2],  # stride(1) 2, width 16
    "row stride not a word": lambda: random_rows(6, 20, 2)[:, :16],  # stride(0) 20
    "offset not a word": lambda: random_rows(7, 16, 3).view(-1)[4:84].view(5, 16),
    "offset not a word at a word address": lambda: _offset_on_a_word_address(),
    "width not a word": lambda: random_rows(6, 16, 4)[:, :12],  # stride(0) 16
}


def _offset_on_a_word_address() -> torch.Tensor:
    """Rows at a word-aligned address whose storage starts 4 bytes before a word: torch
    refuses to view them as int64 (the offset, not the address, must be whole words)."""
    storage = torch.from_numpy(np.zeros(200, dtype=np.uint8)[4:])  # starts at 4 mod 8
    assert storage.data_ptr() % 8 == 4
    rows = storage.view(-1)[4:84].view(5, 16)
    rows.copy_(random_rows(5, 16, 3))
    assert rows.data_ptr() % 8 == 0
    assert rows.storage_offset() == 4
    return rows


@pytest.mark.parametrize("case", _NOT_WORD_ROWS)
def test_byte_rows_that_are_not_whole_words_copy_as_bytes(case: str) -> None:
    """Each of the four conditions alone keeps rows as bytes: viewed as int64, such rows
    fail to view (or would move the wrong bytes)."""
    src = _NOT_WORD_ROWS[case]()
    words = random_rows(5, 16, 9)
    assert row_dtype(src) == torch.uint8
    assert row_dtype(words) == torch.int64
    if src.size(1) == words.size(1):
        assert row_dtype(src, words) == row_dtype(words, src) == torch.uint8
    dst = random_rows(8, src.size(1), 5)
    src_ids, dst_ids = np.array([4, 0, 2, 1]), np.array([7, 3, 0, 5])
    expected = reference_copy(src, src_ids, dst, dst_ids)
    copy_blocks(src, src_ids, dst, dst_ids)
    assert torch.equal(dst, expected)


def test_a_plan_goes_by_runs_when_they_are_few_or_long_else_by_scratch() -> None:
    """The strategy table of the module docstring: two runs go by runs whatever their
    size; more runs go by runs only when they average MIN_RUN_BYTES; else scratch."""
    two_runs = np.array([0, 1, 2, 10, 11, 12])
    scattered = np.array([17, 3, 29, 8, 21, 14])
    assert plan_copy(scattered, two_runs, 8).strategy is CopyStrategy.DST_RUNS
    assert plan_copy(two_runs, scattered, 8).strategy is CopyStrategy.SRC_RUNS
    three_runs = np.array([0, 1, 5, 6, 10, 11])  # 2 rows a run
    long_rows = block_copy.MIN_RUN_BYTES // 2
    assert plan_copy(scattered, three_runs, long_rows).strategy is CopyStrategy.DST_RUNS
    assert plan_copy(scattered, three_runs, long_rows - 1).strategy is CopyStrategy.SCRATCH


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        ([9, 3, 4, 0, 7, 1], [10, 11, 12, 20, 21, 22]),  # DST_RUNS
        ([10, 11, 12, 20, 21, 22], [9, 3, 4, 0, 7, 1]),  # SRC_RUNS
        ([9, 3, 4, 0, 7, 1], [5, 12, 30, 2, 18, 25]),  # SCRATCH
    ],
)
@pytest.mark.parametrize(("a", "b"), [(0, 6), (1, 4), (2, 5), (4, 6), (3, 3)])
def test_a_share_of_a_plan_writes_exactly_its_rows(
    src_ids: list[int], dst_ids: list[int], a: int, b: int
) -> None:
    """`copy_rows(plan, ..., a, b)` copies plan rows a..b and no other: shares run on
    different threads at once, and a share that wrote its neighbours' rows too would
    race them."""
    s, d = np.array(src_ids), np.array(dst_ids)
    plan = plan_copy(s, d, 64)
    src, dst = random_rows(32, 64, 6), torch.zeros(32, 64, dtype=torch.uint8)
    scratch = new_scratch(64)
    copy_rows(plan, as_rows(src), as_rows(dst), a, b, scratch)
    # The plan's row order: destination-sorted, source-sorted, or as given.
    if plan.strategy is CopyStrategy.SCRATCH:
        pairs = list(zip(src_ids, dst_ids, strict=True))
    else:
        by = 1 if plan.strategy is CopyStrategy.DST_RUNS else 0
        pairs = sorted(zip(src_ids, dst_ids, strict=True), key=lambda p: p[by])
    expected = torch.zeros_like(dst)
    for src_id, dst_id in pairs[a:b]:
        expected[dst_id] = src[src_id]
    assert torch.equal(dst, expected)


def test_a_strided_gather_in_several_chunks_copies_every_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Strided small rows are gathered a chunk of SCRATCH_BYTES at a time: every chunk,
    the last one short, lands in its own rows."""
    monkeypatch.setattr(block_copy, "SCRATCH_BYTES", 3 * 32)  # 3 rows a chunk
    wide = random_rows(20, 64, 7)
    src = wide[:, :32]  # not C-contiguous: the chunked path
    dst = random_rows(20, 32, 8)
    src_ids = np.array([19, 2, 7, 7, 11, 0, 5, 13, 3, 16])
    dst_ids = np.arange(4, 14)  # one run: a gather into dst rows 4..14
    expected = reference_copy(src, src_ids, dst, dst_ids)
    copy_blocks(src, src_ids, dst, dst_ids)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize(
    "scratch",
    [np.zeros((4, 16), dtype=np.int32), np.zeros((4, 8), dtype=np.uint8)],
    ids=["other dtype", "other width"],
)
def test_a_scratch_that_does_not_fit_is_replaced_not_used(scratch: np.ndarray) -> None:
    """`run_copy` stages through a scratch of the region's width and dtype: one that
    differs in either is set aside for a fresh one, and the copy is exact."""
    src, dst = random_rows(40, 16, 10), random_rows(40, 16, 11)
    src_ids = np.array([30, 3, 17, 9, 25, 1, 38, 12])
    dst_ids = np.array([5, 33, 20, 0, 14, 27, 8, 39])
    plan = plan_copy(src_ids, dst_ids, 16)
    assert plan.strategy is CopyStrategy.SCRATCH
    expected = reference_copy(src, src_ids, dst, dst_ids)
    run_copy(plan, src, dst, scratch)
    assert torch.equal(dst, expected)
    assert not scratch.any()


def test_copy_blocks_stages_in_the_scratch_it_is_given() -> None:
    """A byte scratch handed to `copy_blocks` is seen as rows of the copied dtype and
    used, not set aside for a fresh 4 MiB one on every call."""
    src, dst = random_rows(40, 16, 12), random_rows(40, 16, 13)
    src_ids = np.array([30, 3, 17, 9, 25, 1, 38, 12])
    dst_ids = np.array([5, 33, 20, 0, 14, 27, 8, 39])
    assert plan_copy(src_ids, dst_ids, 16).strategy is CopyStrategy.SCRATCH
    scratch = np.zeros((64, 16), dtype=np.uint8)
    expected = reference_copy(src, src_ids, dst, dst_ids)
    copy_blocks(src, src_ids, dst, dst_ids, scratch)
    assert torch.equal(dst, expected)
    assert scratch[:8].tobytes() == src[torch.from_numpy(src_ids)].numpy().tobytes()


def test_a_scratch_plan_without_scratch_is_refused() -> None:
    """`copy_rows` needs scratch rows for a SCRATCH plan: it says so (ValueError)."""
    plan = plan_copy(np.array([6, 0, 3, 9]), np.array([1, 7, 4, 10]), 8)
    assert plan.strategy is CopyStrategy.SCRATCH
    rows = as_rows(random_rows(12, 8, 14))
    with pytest.raises(ValueError, match="needs scratch rows"):
        copy_rows(plan, rows, rows.copy(), 0, 4, None)


@pytest.mark.parametrize("width", [1, 7, 512, 70000, 600000])
def test_a_new_scratch_is_about_scratch_bytes(width: int) -> None:
    """`new_scratch` holds as many whole rows as fit in SCRATCH_BYTES (one at least),
    counted in bytes of its dtype."""
    for dtype in (np.uint8, np.int64):
        scratch = new_scratch(width, dtype)
        row_bytes = width * np.dtype(dtype).itemsize
        assert scratch.shape[1] == width
        assert scratch.dtype == dtype
        if row_bytes <= SCRATCH_BYTES:
            assert SCRATCH_BYTES - row_bytes < scratch.nbytes <= SCRATCH_BYTES
        else:
            assert scratch.shape[0] == 1
