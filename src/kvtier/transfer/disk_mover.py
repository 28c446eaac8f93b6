"""Move blocks between engine (or host tier) tensors and the disk tier, double-buffered.

A job's pairs are sorted by slot id and cut into batches of `batch_slots`; consecutive
slots of a batch become one large read or write. With `n` staging buffers per direction
the copy of batch i overlaps the I/O of batches i+1 .. i+n-1:

    store:  copy→buf0 | copy→buf1 | wait buf0, copy→buf0 | ...     (writes run behind)
    load:   read→buf0, read→buf1 | wait buf0, copy out, read→buf0 | ...

A load whose reads all arrived but found bad slots (no valid data, checksum mismatch:
`BadSlotsError`) copies every other slot of each batch out and goes on; once every batch
is copied it raises `PartlyLoadedError` naming the bad slots, so that only the blocks read from
them are suspect. On any other failure (an I/O error, a short read or write, a failed
copy) the job stops submitting, waits for the I/O already queued (buffers are never
reused while the I/O thread owns them) and raises: the whole job is reported failed.
A store first tombstones its slots' old records in a persistent tier's manifest, so one
sync, before its first write, covers the whole job (`DiskTier.prepare_overwrite`). Runs
on one lane thread per direction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from kvtier.offload.plan import SlotRecord
from kvtier.storage.disk_tier import DiskTier, SlotRead
from kvtier.storage.slot_file import BadSlotsError, DiskIOError
from kvtier.transfer.copiers import BlockCopier, StagingRows


class PartlyLoadedError(DiskIOError):
    """A load that copied every slot but `slots` (sorted, distinct) into its destinations
    whole, each verified against its checksum; the bad slots' destinations were not
    written. No copy of the job is still running when it is raised. `seconds`: how long
    the job's copies and reads took, once its lane timed them. Picklable with both."""

    def __init__(self, slots: Iterable[int], message: str, path: str, code: int | None) -> None:
        super().__init__(code, message, path)
        self.slots = tuple(sorted(set(slots)))
        self.seconds: float | None = None

    @classmethod
    def after(cls, slots: set[int], first: BadSlotsError, path: str) -> PartlyLoadedError:
        """Return the error of a load whose bad slots were `slots`; `first` the first
        `BadSlotsError` its reads raised (its message counts that read's bad slots only)."""
        more = f"; {len(slots)} bad slots in the load: {sorted(slots)}" if len(slots) > 1 else ""
        return cls(slots, f"{first.strerror}{more}", path, first.errno)

    def __reduce__(self) -> tuple[Any, ...]:
        # OSError's own would call __init__(errno, strerror, filename).
        args = (self.slots, self.strerror, self.filename, self.errno)
        return type(self), args, {"seconds": self.seconds}


class DiskMover:
    """Store to and load from one `DiskTier`; staging rows are viewed as `dtype` and cut
    into regions at `spans` (in elements of `dtype`)."""

    def __init__(
        self, disk: DiskTier, spans: Sequence[tuple[int, int]], dtype: torch.dtype
    ) -> None:
        self.disk = disk
        self.spans = tuple(spans)
        self._store_rows = tuple(
            StagingRows.of(b.tensor.view(dtype), spans) for b in disk.store_buffers
        )
        self._load_rows = tuple(
            StagingRows.of(b.tensor.view(dtype), spans) for b in disk.load_buffers
        )

    def store(
        self,
        copier: BlockCopier,
        src: Sequence[torch.Tensor],
        src_ids: np.ndarray,
        slot_ids: np.ndarray,
        records: Sequence[SlotRecord] | None = None,
    ) -> None:
        """Write blocks `src[·][src_ids]` to `slot_ids`; raise DiskIOError on failure.

        `records[i]` describes `slot_ids[i]` for a persistent tier's manifest (None: no
        records, the slots' earlier records are dropped)."""
        order = np.argsort(slot_ids, kind="stable")
        src_ids, slot_ids = src_ids[order], slot_ids[order]
        ordered = [records[i] for i in order.tolist()] if records is not None else None
        buffers = self.disk.store_buffers
        if self.disk.persistent:  # the slots' old records go first: one manifest sync
            self.disk.prepare_overwrite(slot_ids.tolist())  # for the job, not per batch
        inflight: deque[Future[None]] = deque()
        try:
            for i, (a, b) in enumerate(_batches(len(slot_ids), self.disk.batch_slots)):
                if len(inflight) == len(buffers):
                    inflight.popleft().result()
                k = i % len(buffers)
                copier.store_to_staging(src, src_ids[a:b], self._store_rows[k])
                batch = ordered[a:b] if ordered is not None else None
                inflight.append(self.disk.write_slots(buffers[k], slot_ids[a:b], batch))
            while inflight:
                inflight.popleft().result()
        finally:
            _drain(inflight)

    def load(
        self,
        copier: BlockCopier,
        slot_ids: np.ndarray,
        dst: Sequence[torch.Tensor],
        dst_ids: np.ndarray,
    ) -> None:
        """Read `slot_ids` into blocks `dst[·][dst_ids]`; raise DiskIOError on failure.

        Raises `PartlyLoadedError` when the only failures were bad slots: every other slot is
        then in its destination. Nothing is copied out of a batch whose read failed;
        earlier batches may already be in `dst`, which is why the whole job is then
        reported failed.
        """
        order = np.argsort(slot_ids, kind="stable")
        slot_ids, dst_ids = slot_ids[order], dst_ids[order]
        buffers = self.disk.load_buffers
        batches = _batches(len(slot_ids), self.disk.batch_slots)
        inflight: deque[SlotRead] = deque()
        bad: set[int] = set()
        first: BadSlotsError | None = None
        try:
            for i, (a, b) in enumerate(batches[: len(buffers)]):
                inflight.append(self.disk.read_slots(buffers[i], slot_ids[a:b]))
            for i, (a, b) in enumerate(batches):
                k = i % len(buffers)
                try:
                    inflight.popleft().result()
                except BadSlotsError as exc:
                    first = first or exc
                    bad.update(exc.slots)
                    self._load_good_rows(copier, k, slot_ids[a:b], dst, dst_ids[a:b], exc.slots)
                else:
                    copier.load_from_staging(self._load_rows[k], dst, dst_ids[a:b])
                if i + len(buffers) < len(batches):
                    na, nb = batches[i + len(buffers)]
                    inflight.append(self.disk.read_slots(buffers[k], slot_ids[na:nb]))
        finally:
            for read in inflight:
                read.wait()
        if first is not None:
            raise PartlyLoadedError.after(bad, first, self.disk.path)

    def _load_good_rows(
        self,
        copier: BlockCopier,
        k: int,
        slots: np.ndarray,
        dst: Sequence[torch.Tensor],
        dst_ids: np.ndarray,
        bad: Sequence[int],
    ) -> None:
        """Copy the rows of load buffer `k` whose slot is not in `bad`, run by run."""
        good = ~np.isin(slots, np.asarray(bad, dtype=slots.dtype))
        staging = self._load_rows[k]
        edges = np.flatnonzero(np.diff(np.concatenate(([False], good, [False])).astype(np.int8)))
        for a, b in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            rows = StagingRows.of(staging.rows[a:b], staging.spans)
            copier.load_from_staging(rows, dst, dst_ids[a:b])


def _batches(num: int, batch: int) -> list[tuple[int, int]]:
    return [(a, min(a + batch, num)) for a in range(0, num, batch)]


def _drain(futures: Iterable[Future[None]]) -> None:
    """Wait for every future, ignoring their errors (the first one is already raised)."""
    for future in futures:
        future.exception()
