"""Batched whole-block copies between 2-D CPU tensors (`[rows, bytes]` uint8 views).

`copy_blocks(src, src_ids, dst, dst_ids)` copies `src[src_ids[i]] → dst[dst_ids[i]]` with
a handful of torch calls, never one per block unless blocks are large. `plan_copy` picks
a strategy once per id pair; `run_copy` applies it to as many regions as share the ids:

    strategy    when                                  torch calls per region
    DST_RUNS    destination ids in long runs          one `index_select(out=dst[run])` per run
    SRC_RUNS    source ids in long runs               one `index_copy_(src[run])` per run
    SCRATCH     both sides fragmented                 gather a chunk into scratch, scatter it

A run is a stretch of consecutive ids once the pairs are sorted by that side. Runs count
as long when they average at least `MIN_RUN_BYTES`, where per-call overhead (~10 µs) is
small against the copy. A side whose ids already count up by one (fresh tier slots,
staging rows) is one run as given and is not sorted: small jobs are mostly fixed cost.

Callers should hand in rows of `row_dtype(...)` (int64 whenever the geometry allows):
torch's CPU kernels move uint8 rows one element at a time, about 10x slower, and
re-viewing tensors on every call costs more than small copies.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import numpy as np
import torch

MIN_RUN_BYTES = 64 << 10
SCRATCH_BYTES = 4 << 20


class CopyStrategy(enum.Enum):
    """How one batched copy is carried out (see the module docstring)."""

    DST_RUNS = "dst_runs"
    SRC_RUNS = "src_runs"
    SCRATCH = "scratch"


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """A copy of `num` rows, decided once and applied to any number of regions.

    DST_RUNS: `index` holds source ids sorted by destination; SRC_RUNS: destination ids
    sorted by source; `runs` are `(a, b, first row)` of the consecutive side, and
    `run_indices[i]` is `index[a:b]` of run i, sliced once for every region. SCRATCH:
    `index` and `other_index` are the source and destination ids as given. `src_span` and
    `dst_span` are the lowest and highest id of each side (`(0, -1)` when empty).
    """

    strategy: CopyStrategy
    num: int
    index: torch.Tensor
    other_index: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]
    src_span: tuple[int, int]
    dst_span: tuple[int, int]
    run_indices: tuple[torch.Tensor, ...] = ()


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


def new_scratch(row_width: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Return a pre-touched `[rows, row_width]` scratch of about SCRATCH_BYTES."""
    row_bytes = max(1, row_width * dtype.itemsize)
    return torch.zeros((max(1, SCRATCH_BYTES // row_bytes), row_width), dtype=dtype)


def plan_copy(src_ids: np.ndarray, dst_ids: np.ndarray, row_bytes: int) -> CopyPlan:
    """Return the cheapest plan for copying rows `src_ids` to rows `dst_ids` (int64 arrays).

    `dst_ids` must not repeat (the last write would win arbitrarily). Raises ValueError
    naming the counts unless both have one id per copied row.
    """
    num = len(src_ids)
    if len(dst_ids) != num:
        raise ValueError(f"{num} source ids but {len(dst_ids)} destination ids")
    for strategy, ordered, other in (
        (CopyStrategy.DST_RUNS, dst_ids, src_ids),
        (CopyStrategy.SRC_RUNS, src_ids, dst_ids),
    ):
        if _is_one_run(ordered):  # already in order: the plan the general case would make
            index = _index(other)
            first = int(ordered[0])
            spans = _spans(strategy, (first, first + num - 1), _span(other))
            return CopyPlan(
                strategy, num, index, index, ((0, num, first),), *spans, run_indices=(index,)
            )
        order = np.argsort(ordered, kind="stable")
        sorted_ids = ordered[order]
        cuts = runs_of(sorted_ids).tolist()
        num_runs = len(cuts) - 1
        if num_runs <= 2 or num * row_bytes >= num_runs * MIN_RUN_BYTES:
            runs = tuple((a, b, int(sorted_ids[a])) for a, b in itertools.pairwise(cuts))
            index = _index(other[order])
            spans = _spans(strategy, _ends(sorted_ids), _span(other))
            run_indices = tuple(index[a:b] for a, b, _ in runs)
            return CopyPlan(strategy, num, index, index, runs, *spans, run_indices=run_indices)
    spans = _span(src_ids), _span(dst_ids)
    return CopyPlan(CopyStrategy.SCRATCH, num, _index(src_ids), _index(dst_ids), (), *spans)


def run_copy(
    plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor, scratch: torch.Tensor | None = None
) -> None:
    """Apply `plan` to one region: 2-D CPU tensors of one dtype and row width.

    Raises ValueError, copying nothing, when an id is outside its tensor's rows (torch
    would silently reallocate an out-of-range destination slice). `scratch` (`[rows, row
    width]`, same dtype) is reused by SCRATCH plans instead of a fresh allocation; not
    thread-safe when shared.
    """
    if src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(
            f"rows differ: {src.shape[1]} x {src.dtype} vs {dst.shape[1]} x {dst.dtype}"
        )
    if plan.num == 0:
        return
    _check_span("source", plan.src_span, src.shape[0])
    _check_span("destination", plan.dst_span, dst.shape[0])
    if plan.strategy is CopyStrategy.SCRATCH:
        _copy_through_scratch(plan, src, dst, scratch)
    elif plan.strategy is CopyStrategy.DST_RUNS:
        for (a, b, lo), index in zip(plan.runs, plan.run_indices, strict=True):
            torch.index_select(src, 0, index, out=dst[lo : lo + b - a])
    else:
        for (a, b, lo), index in zip(plan.runs, plan.run_indices, strict=True):
            dst.index_copy_(0, index, src[lo : lo + b - a])


def copy_blocks(
    src: torch.Tensor,
    src_ids: np.ndarray,
    dst: torch.Tensor,
    dst_ids: np.ndarray,
    scratch: torch.Tensor | None = None,
) -> None:
    """Copy rows `src[src_ids[i]]` into `dst[dst_ids[i]]` (see `plan_copy` / `run_copy`).

    Views both sides as int64 rows when possible (a convenience for one-off copies).
    """
    row_bytes = src.shape[1] * src.element_size()
    dtype = row_dtype(src, dst)
    if dtype != src.dtype:
        src, dst = src.view(dtype), dst.view(dtype)
        scratch = scratch.view(dtype) if scratch is not None else None
    run_copy(plan_copy(src_ids, dst_ids, row_bytes), src, dst, scratch)


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


def _index(ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))


def _copy_through_scratch(
    plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor, scratch: torch.Tensor | None
) -> None:
    """Gather a chunk of rows into `scratch`, scatter it, and repeat."""
    if scratch is None or scratch.shape[1] != dst.shape[1] or scratch.dtype != dst.dtype:
        scratch = new_scratch(dst.shape[1], dst.dtype)
    chunk = scratch.shape[0]
    for a in range(0, plan.num, chunk):
        b = min(a + chunk, plan.num)
        rows = scratch[: b - a]
        torch.index_select(src, 0, plan.index[a:b], out=rows)
        dst.index_copy_(0, plan.other_index[a:b], rows)
