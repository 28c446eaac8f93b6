"""numpy block copies from strided rows (engine regions with a block stride wider than a
block, staging columns): a gather reads the asked rows only, never a copy of the whole
source; and `copy_blocks` keeps working with a scratch for rows it views as bytes."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from kvtier.transfer.block_copy import (
    CopyStrategy,
    copy_blocks,
    new_scratch,
    plan_copy,
    run_copy,
)
from kvtier.transfer.copiers import CpuCopier, StagingRows
from kvtier.transfer.copy_crew import CopyCrew

_WIDTH = 1024  # int64 elements: 8 KiB rows
_BLOCKS = 4096  # 32 MiB of strided source rows


def _strided_source() -> torch.Tensor:
    """Return `[_BLOCKS, _WIDTH]` int64 rows every other row of a wider allocation (the K
    half of a `[num_blocks, 2, ...]` tensor), filled with distinct values."""
    base = torch.arange(_BLOCKS * 2 * _WIDTH, dtype=torch.int64).view(_BLOCKS, 2 * _WIDTH)
    view = base[:, :_WIDTH]
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "strategy"),
    [
        (np.array([7, 100, 3000]), np.array([0, 1, 2]), CopyStrategy.DST_RUNS),
        (np.arange(0, 96, 3), np.arange(64, 0, -2), CopyStrategy.SCRATCH),
    ],
)
def test_gather_from_strided_rows_allocates_no_copy_of_the_source(
    src_ids: np.ndarray, dst_ids: np.ndarray, strategy: CopyStrategy
) -> None:
    """A host store from a strided engine region: np.take copied all 32 MiB of the source
    (C-contiguous first) for every call, to move a few 8 KiB rows."""
    src = _strided_source()
    dst = torch.zeros((80, _WIDTH), dtype=torch.int64)
    src_ids, dst_ids = src_ids.astype(np.int64), dst_ids.astype(np.int64)
    assert plan_copy(src_ids, dst_ids, _WIDTH * 8).strategy is strategy
    crew = CopyCrew(1, "strided")
    try:
        copier = CpuCopier(crew)
        copier.store([src], src_ids, [dst], dst_ids)  # warm: scratch, plans
        tracemalloc.start()
        try:
            copier.store([src], src_ids, [dst], dst_ids)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        crew.close()
    expected = torch.zeros_like(dst)
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        expected[d] = src[s]
    assert torch.equal(dst, expected)
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB allocated to copy {len(src_ids)} rows"


def test_copy_blocks_with_scratch_on_rows_it_views_as_bytes() -> None:
    """float16 rows of 6 bytes are copied as uint8 rows; the scratch handed in must be
    viewed as bytes too (it was viewed as int64: ValueError, 6 bytes per row)."""
    src = torch.arange(40 * 3, dtype=torch.float16).view(40, 3)
    dst = torch.zeros((40, 3), dtype=torch.float16)
    src_ids = np.array([5, 1, 9, 30, 2, 17], dtype=np.int64)
    dst_ids = np.array([3, 20, 0, 11, 39, 7], dtype=np.int64)
    assert plan_copy(src_ids, dst_ids, 6).strategy is CopyStrategy.SCRATCH
    copy_blocks(src, src_ids, dst, dst_ids, scratch=new_scratch(3, np.float16))
    expected = torch.zeros_like(dst)
    expected[torch.from_numpy(dst_ids)] = src[torch.from_numpy(src_ids)]
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_run_copy_rows_of_a_dtype_numpy_lacks(dtype: torch.dtype) -> None:
    """Rows numpy has no dtype for are copied as their bytes (torch's index kernels took
    float8 rows; the numpy path raised TypeError for all but bfloat16)."""
    src = torch.arange(16 * 4, dtype=torch.uint8).view(16, 4).view(dtype)
    dst = torch.zeros((16, 4), dtype=torch.uint8).view(dtype)
    src_ids = np.array([3, 0, 9, 15], dtype=np.int64)
    dst_ids = np.array([1, 2, 3, 4], dtype=np.int64)
    run_copy(plan_copy(src_ids, dst_ids, 4 * src.element_size()), src, dst)
    expected = torch.zeros((16, 4), dtype=torch.uint8)
    expected[1:5] = src.view(torch.uint8)[torch.from_numpy(src_ids)]
    assert torch.equal(dst.view(torch.uint8), expected)


@pytest.mark.parametrize("crew_size", [1, 2])
@pytest.mark.parametrize("row_kib", [8, 64, 256])
def test_strided_gathers_row_by_row_or_by_chunks_copy_exactly(row_kib: int, crew_size: int) -> None:
    """Rows of >= ROW_LOOP_BYTES from a strided source go row by row, smaller ones by
    chunks; into contiguous host rows (a store) and into staging columns (a disk store)."""
    width = row_kib << 7  # int64 elements
    base = torch.randint(0, 2**62, (24, 3 * width), dtype=torch.int64)
    src = base[:, width : 2 * width]  # the middle third: strided rows
    src_ids = np.array([17, 3, 22, 9, 0, 11, 5], dtype=np.int64)
    crew = CopyCrew(crew_size, "rowloop", min_share_bytes=1)
    try:
        copier = CpuCopier(crew)
        host = torch.zeros((8, width), dtype=torch.int64)
        copier.store([src], src_ids, [host], np.arange(1, 8))
        assert torch.equal(host[1:], src[torch.from_numpy(src_ids)])
        assert not host[0].any()
        staging = StagingRows.of(
            torch.zeros(8, 2 * width, dtype=torch.int64), [(0, width), (width, 2 * width)]
        )
        copier.store_to_staging([src, base[:, :width]], src_ids, staging)
        assert torch.equal(staging.columns[0][:7], src[torch.from_numpy(src_ids)])
        assert torch.equal(staging.columns[1][:7], base[torch.from_numpy(src_ids), :width])
        assert not staging.rows[7].any()
    finally:
        crew.close()


def _every_other_column(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Return `[rows, 2 * width]` random values of `dtype`; its even columns are the rows
    under test, whose elements are 2 apart."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (rows, 2 * width), generator=generator).to(dtype)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float8_e5m2, torch.float16, torch.float32, torch.int64]
)
@pytest.mark.parametrize("entry", ["copy_blocks", "run_copy", "CpuCopier"])
def test_rows_whose_elements_are_not_adjacent_copy_in_every_dtype(
    dtype: torch.dtype, entry: str
) -> None:
    """Rows with an innermost stride of 2 elements, through each CPU entry point. Viewing
    them as bytes raised RuntimeError ("self.stride(-1) must be 1"): bfloat16 everywhere
    (numpy lacks it), and every dtype but one-byte ones in `copy_blocks` (which saw rows
    of any other dtype as bytes)."""
    src = _every_other_column(16, 6, dtype, seed=1)[:, ::2]
    wide_dst = _every_other_column(16, 6, dtype, seed=2)
    dst = wide_dst[:, ::2]
    assert src.stride() == dst.stride() == (12, 2)
    expected = wide_dst.clone()
    src_ids = np.array([3, 0, 9, 15, 4], dtype=np.int64)
    dst_ids = np.array([1, 2, 7, 4, 11], dtype=np.int64)
    expected[torch.from_numpy(dst_ids), ::2] = src[torch.from_numpy(src_ids)]
    if entry == "copy_blocks":
        copy_blocks(src, src_ids, dst, dst_ids)
    elif entry == "run_copy":
        run_copy(plan_copy(src_ids, dst_ids, 6 * src.element_size()), src, dst)
    else:
        crew = CopyCrew(2, "every-other", min_share_bytes=1)
        try:
            CpuCopier(crew).store([src], src_ids, [dst], dst_ids)
        finally:
            crew.close()
    assert torch.equal(wide_dst.float(), expected.float())  # odd columns untouched too
