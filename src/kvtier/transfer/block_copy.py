"""Batched whole-block copies between 2-D CPU tensors (`[rows, bytes]` views).

`copy_blocks(src, src_ids, dst, dst_ids)` copies `src[src_ids[i]] → dst[dst_ids[i]]` with
a handful of numpy calls, never one per block unless blocks are large. `plan_copy` picks
a strategy once per id pair; `copy_rows` applies it to one region, or to a share of its
rows (`copy_crew` splits a batch of regions over threads):

    strategy    when                                  numpy calls per region
    DST_RUNS    destination ids in long runs          one gather (`take`) into dst[run] per run
    SRC_RUNS    source ids in long runs               one scatter (`dst[ids] = src[run]`) per run
    SCRATCH     both sides fragmented                 gather a chunk into scratch, scatter it

A run is a stretch of consecutive ids once the pairs are sorted by that side. Runs count
as long when they average at least `MIN_RUN_BYTES`, where per-call overhead is small
against the copy. A side whose ids already count up by one (fresh tier slots, staging
rows) is one run as given and is not sorted: small jobs are mostly fixed cost.

numpy, not torch: its gathers and scatters move whole rows with memcpy and release the
GIL. Measured on 2 cores (64 MiB in 8-byte rows of 64 KiB - 2 MiB, one thread, GB/s):
numpy gather 11, scatter 9-11; torch `copy_` of one contiguous buffer 7, `index_select`
7-8, `index_copy_` 4.5-5; and with 2 threads torch's `index_copy_` reaches only 10 while
two numpy threads reach 24-26 (contiguous `copy_` 21). Callers should hand in rows of
`row_dtype(...)` (int64 whenever the geometry allows): uint8 rows cost more per element.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from dataclasses import dataclass

import numpy as np
import torch

MIN_RUN_BYTES = 64 << 10
SCRATCH_BYTES = 4 << 20
ROW_LOOP_BYTES = 64 << 10  # strided rows this big are gathered one at a time (`_gather`)
# Integer dtypes numpy has, by element size: how rows of a dtype numpy lacks are seen.
_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CopyStrategy(enum.Enum):
    """How one batched copy is carried out (see the module docstring)."""

    DST_RUNS = "dst_runs"
    SRC_RUNS = "src_runs"
    SCRATCH = "scratch"


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """A copy of `num` rows, decided once and applied to any number of regions.

    Its rows are numbered 0..num in the plan's order. DST_RUNS: `index` holds source ids
    sorted by destination; SRC_RUNS: destination ids sorted by source; `runs` are `(a, b,
    first id)` of the consecutive side over plan rows `a..b`, and `run_starts` their `a`.
    SCRATCH: `index` and `other_index` are the source and destination ids as given.
    `src_span` and `dst_span` are the lowest and highest id of each side (`(0, -1)` when
    empty).
    """

    strategy: CopyStrategy
    num: int
    index: np.ndarray
    other_index: np.ndarray
    runs: tuple[tuple[int, int, int], ...]
    src_span: tuple[int, int]
    dst_span: tuple[int, int]
    run_starts: tuple[int, ...] = ()


def runs_of(sorted_ids: np.ndarray) -> np.ndarray:
    """Return the start indices of runs of consecutive ids, plus `len(sorted_ids)` at the end."""
    if len(sorted_ids) == 0:
        return np.zeros(1, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    return np.concatenate(([0], breaks, [len(sorted_ids)])).astype(np.int64)


def row_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Return int64 when every 2-D uint8 tensor can be viewed as 8-byte rows, else uint8."""
    for t in tensors:
        if t.dtype != torch.uint8 or t.dim() != 2 or t.stride(1) != 1:
            return torch.uint8
        if t.size(1) % 8 or t.stride(0) % 8 or t.storage_offset() % 8 or t.data_ptr() % 8:
            return torch.uint8
    return torch.int64


def as_rows(t: torch.Tensor) -> np.ndarray:
    """Return the numpy view of a 2-D CPU tensor of rows (its memory, not a copy).

    Rows of a dtype numpy lacks (bfloat16, float8, ...) are seen as integers of the same
    size, which keeps every stride: seen as bytes, rows whose elements are not adjacent
    (the even columns of a wider tensor) could not be viewed at all.
    """
    try:
        return t.numpy()
    except TypeError:  # "unsupported ScalarType": no numpy dtype for it
        same_size = _SAME_SIZE_INTS.get(t.element_size(), torch.uint8)
        return t.view(same_size).numpy()


def new_scratch(row_width: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """Return a pre-touched `[rows, row_width]` scratch of about SCRATCH_BYTES."""
    dtype = np.dtype(dtype)
    row_bytes = max(1, row_width * dtype.itemsize)
    scratch = np.empty((max(1, SCRATCH_BYTES // row_bytes), row_width), dtype=dtype)
    scratch.fill(0)  # touch every page now, not during the first copy
    return scratch


def plan_copy(src_ids: np.ndarray, dst_ids: np.ndarray, row_bytes: int) -> CopyPlan:
    """Return the cheapest plan for copying rows `src_ids` to rows `dst_ids` (int64 arrays).

    `dst_ids` must not repeat (the last write would win arbitrarily). Raises ValueError
    naming the counts unless both have one id per copied row.
    """
    num = len(src_ids)
    if len(dst_ids) != num:
        raise ValueError(f"{num} source ids but {len(dst_ids)} destination ids")
    sides = (
        (CopyStrategy.DST_RUNS, dst_ids, src_ids),
        (CopyStrategy.SRC_RUNS, src_ids, dst_ids),
    )
    for strategy, ordered, other in sides:
        if _is_one_run(ordered):  # already in order: the plan the general case would make
            index = _index(other)
            first = int(ordered[0])
            spans = _spans(strategy, (first, first + num - 1), _span(other))
            return CopyPlan(strategy, num, index, index, ((0, num, first),), *spans, (0,))
    # The side in fewer runs (a numpy call each), if its runs are long enough.
    strategy, ordered, other, order, sorted_ids, cuts = min(
        (_sorted_runs(*side) for side in sides), key=lambda found: len(found[-1])
    )
    num_runs = len(cuts) - 1
    if num_runs <= 2 or num * row_bytes >= num_runs * MIN_RUN_BYTES:
        runs = tuple((a, b, int(sorted_ids[a])) for a, b in itertools.pairwise(cuts))
        index = _index(other[order])
        spans = _spans(strategy, _ends(sorted_ids), _span(other))
        return CopyPlan(strategy, num, index, index, runs, *spans, tuple(cuts[:-1]))
    spans = _span(src_ids), _span(dst_ids)
    return CopyPlan(CopyStrategy.SCRATCH, num, _index(src_ids), _index(dst_ids), (), *spans)


def check_region(
    plan: CopyPlan, src: torch.Tensor | np.ndarray, dst: torch.Tensor | np.ndarray
) -> None:
    """Raise ValueError unless `plan` fits one region: rows of one width and dtype on
    both sides, every id inside its side's rows (an out-of-range write would corrupt
    memory or, through torch, silently reallocate the destination)."""
    if src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(
            f"rows differ: {src.shape[1]} x {src.dtype} vs {dst.shape[1]} x {dst.dtype}"
        )
    if plan.num:
        _check_span("source", plan.src_span, src.shape[0])
        _check_span("destination", plan.dst_span, dst.shape[0])


def fits(scratch: np.ndarray | None, rows: np.ndarray) -> bool:
    """Return True if `scratch` can stage `rows`' rows: same width and dtype."""
    return scratch is not None and scratch.shape[1] == rows.shape[1] and scratch.dtype == rows.dtype


def copy_rows(
    plan: CopyPlan, src: np.ndarray, dst: np.ndarray, a: int, b: int, scratch: np.ndarray | None
) -> None:
    """Copy plan rows `a..b` of one region `check_region` accepted; SCRATCH plans need
    `scratch` (rows of the region's width and dtype). Shares of disjoint rows may run
    on different threads at once (each with its own scratch): they write disjoint rows.
    """
    if a >= b:
        return
    if plan.strategy is CopyStrategy.SCRATCH:
        if scratch is None:
            raise ValueError("a scratch plan needs scratch rows")
        chunk = scratch.shape[0]
        for c in range(a, b, chunk):
            e = min(c + chunk, b)
            rows = scratch[: e - c]
            _gather(src, plan.index[c:e], rows)
            dst[plan.other_index[c:e]] = rows
        return
    gather = plan.strategy is CopyStrategy.DST_RUNS
    runs = plan.runs
    if len(runs) > 1:  # skip the runs before row a
        runs = runs[bisect.bisect_right(plan.run_starts, a) - 1 :]
    for ra, rb, lo in runs:
        if ra >= b:
            break
        s, e = max(a, ra), min(b, rb)
        ids, block = plan.index[s:e], slice(lo + s - ra, lo + e - ra)
        if gather:
            _gather(src, ids, dst[block])
        else:
            dst[ids] = src[block]


def _gather(src: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """Copy rows `src[ids]` into `out` (ids already checked in range).

    `take` with mode="clip" writes straight into a C-contiguous `out`, but it first copies
    a source that is not C-contiguous whole (a strided engine region, a staging column):
    gigabytes to move a few rows; and it stages a strided `out` (a staging column) in a
    copy read from `out` and written back (3 passes). Those cases go row by row when rows
    have >= ROW_LOOP_BYTES, else by indexing a chunk at a time (through a temporary: 2
    passes). Measured on 2 cores, GB/s, one thread / two: row by row 6.6-7.8 / 8.5-14 at
    64 KiB - 1 MiB rows, 5.0 / 4.1 at 16 KiB (two threads contend for the GIL); indexing
    3.7-4.8 / 5.8-8.2.
    """
    if src.flags.c_contiguous and out.flags.c_contiguous:
        src.take(ids, axis=0, out=out, mode="clip")
        return
    row_bytes = max(1, src.shape[1] * src.dtype.itemsize)
    if row_bytes >= ROW_LOOP_BYTES:
        for row, i in enumerate(ids.tolist()):
            out[row] = src[i]
        return
    step = max(1, SCRATCH_BYTES // row_bytes)
    for c in range(0, len(ids), step):
        out[c : c + step] = src[ids[c : c + step]]


def run_copy(
    plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor, scratch: np.ndarray | None = None
) -> None:
    """Apply `plan` to one region on the calling thread: 2-D CPU tensors of one dtype and
    row width. Raises ValueError, copying nothing, unless `check_region` accepts them.
    `scratch` (`[rows, row width]`, same dtype) is reused by SCRATCH plans instead of a
    fresh allocation; not thread-safe when shared.
    """
    check_region(plan, src, dst)
    src_rows, dst_rows = as_rows(src), as_rows(dst)
    if plan.strategy is CopyStrategy.SCRATCH and not fits(scratch, dst_rows):
        scratch = new_scratch(dst_rows.shape[1], dst_rows.dtype)
    copy_rows(plan, src_rows, dst_rows, 0, plan.num, scratch)


def copy_blocks(
    src: torch.Tensor,
    src_ids: np.ndarray,
    dst: torch.Tensor,
    dst_ids: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """Copy rows `src[src_ids[i]]` into `dst[dst_ids[i]]` (see `plan_copy` / `run_copy`).

    Views byte rows as int64 rows when possible (a convenience for one-off copies); rows
    of other dtypes are copied as they are, whatever their strides. `scratch`, of any
    dtype, is seen as rows of the copied dtype.
    """
    row_bytes = src.shape[1] * src.element_size()
    if row_dtype(src, dst) == torch.int64:  # byte rows that read as 8-byte words
        src, dst = src.view(torch.int64), dst.view(torch.int64)
    if scratch is not None:  # as bytes, then as the rows numpy copies
        scratch = scratch.view(np.uint8).view(as_rows(dst).dtype)
    run_copy(plan_copy(src_ids, dst_ids, row_bytes), src, dst, scratch)


def _sorted_runs(
    strategy: CopyStrategy, ordered: np.ndarray, other: np.ndarray
) -> tuple[CopyStrategy, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Return the side as given, its sort order, its sorted ids and their run cuts."""
    order = np.argsort(ordered, kind="stable")
    sorted_ids = ordered[order]
    return strategy, ordered, other, order, sorted_ids, runs_of(sorted_ids).tolist()


def _is_one_run(ids: np.ndarray) -> bool:
    """Return True if `ids` are not empty and count up by one: one run, already sorted."""
    num = len(ids)
    if num == 0 or int(ids[-1]) - int(ids[0]) != num - 1:
        return False
    return num == 1 or bool((np.diff(ids) == 1).all())


def _span(ids: np.ndarray) -> tuple[int, int]:
    return (int(ids.min()), int(ids.max())) if len(ids) else (0, -1)


def _ends(sorted_ids: np.ndarray) -> tuple[int, int]:
    """Return `_span` of sorted ids: their first and last."""
    return (int(sorted_ids[0]), int(sorted_ids[-1])) if len(sorted_ids) else (0, -1)


def _spans(
    strategy: CopyStrategy, run_side: tuple[int, int], other_side: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Return `(src_span, dst_span)` from the spans of a plan's run side and other side."""
    if strategy is CopyStrategy.DST_RUNS:
        return other_side, run_side
    return run_side, other_side


def _check_span(side: str, span: tuple[int, int], num_rows: int) -> None:
    low, high = span
    if low < 0 or high >= num_rows:
        bad = low if low < 0 else high
        raise ValueError(f"{side} id {bad} outside [0, {num_rows})")


def _index(ids: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ids, dtype=np.int64)
