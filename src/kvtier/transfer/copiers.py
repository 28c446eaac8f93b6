"""Copy whole blocks between the engine's regions and host tensors, per device.

A copier belongs to one transfer lane (one thread). Views are `[rows, width]` tensors, one
per region, all of one row dtype (int64 when the geometry allows, see `row_dtype`); ids
are int64 numpy arrays, validated by the worker.

- `CpuCopier`: engine tensors on the CPU (and host tier ↔ disk staging on any machine);
  every copy is synchronous (split over the lane's `CopyCrew`), `finish()` returns None.
- `CudaCopier`: engine tensors on a GPU, host tensors page-locked. Work is queued on the
  lane's lowest-priority stream: a gather/scatter kernel on the device side plus one DMA
  per run of consecutive host rows; `finish()` returns a completion event. Copies into or
  out of a staging buffer synchronize before returning, because the buffer is reused; so
  does a copy that raises, so that a failed job has no work left running.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvtier.transfer.block_copy import CopyPlan, as_rows, check_region, plan_copy, runs_of
from kvtier.transfer.copy_crew import CopyCrew, RegionCopy
from kvtier.transfer.device import (
    Completion,
    CudaCompletion,
    lowest_priority_stream,
    timing_event,
)

Views = Sequence[torch.Tensor]

_DEVICE_CHUNK_BYTES = 256 << 20  # bound on device scratch per region and call
# Staging copies feed a disk (about 2 GB/s here), which one copying thread outpaces;
# helpers would take the cores the disk tier's I/O threads need.
_STAGING_THREADS = 1


@dataclass(frozen=True, eq=False)
class StagingRows:
    """A host staging buffer in slot layout, seen whole and region by region.

    `rows` is `[capacity, slot width]`; `columns[r]` is the `[capacity, region width]`
    view of region r; `spans[r]` its `[start, end)` in `rows`' elements.
    """

    rows: torch.Tensor
    columns: tuple[torch.Tensor, ...]
    spans: tuple[tuple[int, int], ...]

    @staticmethod
    def of(rows: torch.Tensor, spans: Sequence[tuple[int, int]]) -> StagingRows:
        """Return the staging view of `rows` cut at `spans`."""
        columns = tuple(rows[:, a:b] for a, b in spans)
        return StagingRows(rows, columns, tuple(spans))


class BlockCopier(Protocol):
    """Batched block copies of one lane (one thread)."""

    def wait_for_compute(self, marker: torch.cuda.Event | None) -> None:
        """Make later reads of engine blocks wait for the forward pass that `marker` ends."""
        ...

    def begin(self) -> None:
        """Mark the start of a job's copies (after `wait_for_compute`), for its timing."""
        ...

    def store(self, src: Views, src_ids: np.ndarray, dst: Views, dst_ids: np.ndarray) -> None:
        """Copy engine blocks `src_ids` into host rows `dst_ids`, region by region."""
        ...

    def load(self, src: Views, src_ids: np.ndarray, dst: Views, dst_ids: np.ndarray) -> None:
        """Copy host rows `src_ids` into engine blocks `dst_ids`, region by region."""
        ...

    def store_to_staging(self, src: Views, src_ids: np.ndarray, staging: StagingRows) -> None:
        """Fill staging rows `0..len(src_ids)` from engine blocks; synchronous."""
        ...

    def load_from_staging(self, staging: StagingRows, dst: Views, dst_ids: np.ndarray) -> None:
        """Copy staging rows `0..len(dst_ids)` into engine blocks `dst_ids`; synchronous."""
        ...

    def finish(self) -> Completion | None:
        """Return a marker of the queued work, or None when it already finished."""
        ...


class CpuCopier:
    """`BlockCopier` for CPU tensors; splits each batch over its lane's crew of threads."""

    def __init__(self, crew: CopyCrew) -> None:
        self._crew = crew

    def wait_for_compute(self, marker: torch.cuda.Event | None) -> None:
        """Do nothing: a CPU forward pass has finished when the engine submits."""

    def begin(self) -> None:
        """Do nothing: CPU copies are synchronous, their lane times them."""

    def store(self, src: Views, src_ids: np.ndarray, dst: Views, dst_ids: np.ndarray) -> None:
        """Copy engine blocks into host rows."""
        self._copy(zip(src, dst, strict=True), src_ids, dst_ids)

    def load(self, src: Views, src_ids: np.ndarray, dst: Views, dst_ids: np.ndarray) -> None:
        """Copy host rows into engine blocks."""
        self._copy(zip(src, dst, strict=True), src_ids, dst_ids)

    def store_to_staging(self, src: Views, src_ids: np.ndarray, staging: StagingRows) -> None:
        """Gather engine blocks into the leading staging rows, on the lane's thread only."""
        rows = np.arange(len(src_ids), dtype=np.int64)
        self._copy(zip(src, staging.columns, strict=True), src_ids, rows, _STAGING_THREADS)

    def load_from_staging(self, staging: StagingRows, dst: Views, dst_ids: np.ndarray) -> None:
        """Scatter the leading staging rows into engine blocks, on the lane's thread only."""
        rows = np.arange(len(dst_ids), dtype=np.int64)
        self._copy(zip(staging.columns, dst, strict=True), rows, dst_ids, _STAGING_THREADS)

    def finish(self) -> Completion | None:
        """Return None: every copy already finished."""
        return None

    def _copy(
        self,
        pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        max_threads: int | None = None,
    ) -> None:
        """Copy every (source, destination) region pair, planning once per row width.

        Every region is checked before any is copied: a bad one copies nothing."""
        plans: dict[int, CopyPlan] = {}
        copies = []
        for src, dst in pairs:
            width = int(src.shape[1])
            plan = plans.get(width)
            if plan is None:
                plan = plans[width] = plan_copy(src_ids, dst_ids, width * src.element_size())
            check_region(plan, src, dst)
            copies.append(RegionCopy(plan, as_rows(src), as_rows(dst)))
        self._crew.run(copies, max_threads)


class CudaCopier:
    """`BlockCopier` between CUDA engine tensors and page-locked host tensors."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = lowest_priority_stream(device)
        self._start: torch.cuda.Event | None = None

    def wait_for_compute(self, marker: torch.cuda.Event | None) -> None:
        """Make the lane's stream wait for the engine's compute-done event."""
        if marker is not None:
            self._stream.wait_event(marker)

    def begin(self) -> None:
        """Record a timing event on the lane's stream: the job's copies start there."""
        with torch.cuda.device(self._device):
            self._start = timing_event(self._stream)

    def store(self, src: Views, src_ids: np.ndarray, dst: Views, dst_ids: np.ndarray) -> None:
        """Gather on the device, then one DMA per run of consecutive host rows."""
        order = np.argsort(dst_ids, kind="stable")
        host_rows = dst_ids[order]
        with self._queueing():
            index = self._to_device(src_ids[order])
            for view, host in zip(src, dst, strict=True):
                for a, b in _chunks(len(order), view.shape[1] * view.element_size()):
                    staged = view.index_select(0, index[a:b])
                    for ra, rb, lo in _row_runs(host_rows[a:b]):
                        host[lo : lo + rb - ra].copy_(staged[ra:rb], non_blocking=True)

    def load(self, src: Views, src_ids: np.ndarray, dst: Views, dst_ids: np.ndarray) -> None:
        """One DMA per run of consecutive host rows into device scratch, then scatter."""
        order = np.argsort(src_ids, kind="stable")
        host_rows = src_ids[order]
        with self._queueing():
            index = self._to_device(dst_ids[order])
            for host, view in zip(src, dst, strict=True):
                for a, b in _chunks(len(order), view.shape[1] * view.element_size()):
                    shape = (b - a, view.shape[1])
                    staged = torch.empty(shape, dtype=view.dtype, device=self._device)
                    for ra, rb, lo in _row_runs(host_rows[a:b]):
                        staged[ra:rb].copy_(host[lo : lo + rb - ra], non_blocking=True)
                    view.index_copy_(0, index[a:b], staged)

    def store_to_staging(self, src: Views, src_ids: np.ndarray, staging: StagingRows) -> None:
        """Assemble slots on the device, one DMA into the staging buffer, wait for it."""
        num = len(src_ids)
        rows = staging.rows
        with self._queueing():
            index = self._to_device(src_ids)
            slots = torch.empty((num, rows.shape[1]), dtype=rows.dtype, device=self._device)
            for view, (a, b) in zip(src, staging.spans, strict=True):
                slots[:, a:b].copy_(view.index_select(0, index))
            rows[:num].copy_(slots, non_blocking=True)
        self._stream.synchronize()

    def load_from_staging(self, staging: StagingRows, dst: Views, dst_ids: np.ndarray) -> None:
        """One DMA of the staging rows to the device, scatter per region, wait for it."""
        num = len(dst_ids)
        rows = staging.rows
        with self._queueing():
            index = self._to_device(dst_ids)
            slots = torch.empty((num, rows.shape[1]), dtype=rows.dtype, device=self._device)
            slots.copy_(rows[:num], non_blocking=True)
            for view, (a, b) in zip(dst, staging.spans, strict=True):
                view.index_copy_(0, index, slots[:, a:b])
        self._stream.synchronize()

    def finish(self) -> Completion | None:
        """Return an event recorded after the queued work (timed from `begin`)."""
        start, self._start = self._start, None
        return CudaCompletion(self._stream, start)

    @contextlib.contextmanager
    def _queueing(self) -> Iterator[None]:
        """Make the lane's device, then its stream, current on the calling (lane) thread.

        A lane thread starts on device 0: without the device guard, leaving the stream
        context would switch it back there, which creates a CUDA context on GPU 0 (CUDA 12+)
        in every process whose GPU is another, e.g. vLLM's ranks 1 and up. If the work
        raises, wait for what it already queued: the job is reported failed at once, and
        its copies must not go on writing host slots or GPU blocks handed on since.
        """
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            try:
                yield
            except BaseException:
                with contextlib.suppress(Exception):  # the error to report is the first one
                    self._stream.synchronize()
                raise

    def _to_device(self, ids: np.ndarray) -> torch.Tensor:
        # From pinned memory the copy is asynchronous; from pageable memory CUDA would first
        # synchronize the stream, i.e. wait for the compute-done event on this thread.
        pinned = torch.from_numpy(np.ascontiguousarray(ids)).pin_memory()
        return pinned.to(self._device, non_blocking=True)


def _chunks(num_rows: int, row_bytes: int) -> list[tuple[int, int]]:
    step = max(1, _DEVICE_CHUNK_BYTES // max(1, row_bytes))
    return [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]


def _row_runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Return `(a, b, first row)` for each run of consecutive rows in sorted `rows`."""
    cuts = runs_of(rows).tolist()
    return [(a, b, int(rows[a])) for a, b in itertools.pairwise(cuts)]
