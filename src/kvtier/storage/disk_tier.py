"""The disk tier: a slot file, per-slot checksums, staging buffers and two I/O threads.

The store side and the load side each own an I/O thread and `num_buffers` staging
buffers (page-aligned, `batch_slots` slots each). A caller (the transfer worker's copy
thread) fills a store buffer and hands it to `write_slots`, or hands an empty load buffer
to `read_slots` and copies out of it once the future resolves; with two buffers per side
copying one batch overlaps the I/O of the next. Consecutive slot ids in a batch become one
large read or write.

Every written slot gets a 64-bit xxh3 checksum, verified on read: a load never returns
bytes that differ from what was stored. A slot whose last write failed, or that was never
written, fails to load. Failures surface as `DiskIOError` from the future; the I/O threads
themselves never die from them. Checksums are computed by the thread that filled a store
buffer and verified by the thread that consumes a load buffer (the data is hot in their
caches, and the I/O threads keep the device busy with nothing but reads and writes);
they are `slot_checksums`'s.

A persistent tier (`DiskTierConfig.fingerprint` set) keeps its slot file and a manifest
(see `manifest`) across runs; its records, and the order in which data and records are
made durable, are `disk_tier_records`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import numpy as np

from kvtier.offload.plan import SlotRecord
from kvtier.storage.close_gate import CloseGate
from kvtier.storage.disk_io import Claim, IoThread, check_slot_ids, consecutive_runs, slot_id_list
from kvtier.storage.disk_tier_close import close_dropped, close_files
from kvtier.storage.disk_tier_config import DiskTierConfig
from kvtier.storage.disk_tier_records import DiskRecords
from kvtier.storage.manifest import (
    ManifestLog,
    check_manifest_paths,
    check_no_persistent_tier,
    open_manifest,
    remove_manifest,
)
from kvtier.storage.pending_puts import PendingPuts
from kvtier.storage.slot_checksums import SlotChecksums, bad_slots_error
from kvtier.storage.slot_file import DIRECT_IO_ALIGNMENT, FileIO, SlotFile
from kvtier.storage.staging import SlotRead, StagingBuffer

__all__ = ["DiskTier", "DiskTierConfig", "SlotRead", "StagingBuffer"]

logger = logging.getLogger(__name__)


class DiskTier:
    """One rank's disk tier. Thread affinity: `write_slots` buffers belong to the caller
    until their future resolves; store-side and load-side calls may come from two
    different threads; `close()` waits for queued I/O."""

    def __init__(self, config: DiskTierConfig, file_io: FileIO | None = None) -> None:
        """Open the tier's files (see `SlotFile`, `open_manifest`; a directory where the
        manifest goes is refused first, see `check_manifest_paths`); every error names the
        file, a directory made at one of the tier's paths after that check included. A
        failed open leaves nothing open: what it opened (the slot file and its lock, the
        manifest) is closed as `close()` closes it. A persistent tier whose manifest cannot
        be rewritten (a full disk) raises OSError and leaves the manifest as it was, so a
        later open still recovers it."""
        self.config = config
        identity = config.identity
        check_manifest_paths(config.path)
        if identity is None:
            check_no_persistent_tier(config.path)
        self._checksums = SlotChecksums(config.num_slots, config.bytes_per_slot)
        # Allocated before the files are opened: a failure here has nothing to release.
        self.store_buffers = self._allocate_buffers()
        self.load_buffers = self._allocate_buffers()
        self._file = SlotFile(
            config.path,
            config.num_slots,
            config.bytes_per_slot,
            config.io_mode,
            file_io,
            persistent=identity is not None,
        )
        log: ManifestLog | None = None
        pending: PendingPuts | None = None
        recovered: dict[int, SlotRecord] = {}
        try:
            if identity is None:
                remove_manifest(config.path)  # under the new file's lock
            else:
                log, live = open_manifest(self._file, identity)
                for slot in sorted(live):
                    self._checksums.restore(slot, live[slot].checksum)
                    recovered[slot] = live[slot].record
                pending = PendingPuts(log, self._file.sync_data, config.bytes_per_slot)
        except BaseException:
            close_files(self._file, log)  # never raises for a failed sync or removal
            raise
        self._records = DiskRecords(self._file.path, log, pending, recovered)
        # The I/O threads, recorded as each starts: close() from one of them (a future's
        # done-callback) must not wait for it.
        self._io_threads: set[threading.Thread] = set()
        self._store_io = IoThread("store", self._io_threads)
        self._load_io = IoThread("load", self._io_threads)
        self._closing = CloseGate()
        # Collection without close() commits the pending records and closes the files as
        # close() does, once the I/O threads stopped. Queued I/O holds this object, so
        # none is left then, but at interpreter exit (finalizers run on live objects) the
        # I/O queued is finished first.
        io = (self._store_io, self._load_io)
        self._finalizer = weakref.finalize(self, close_dropped, io, self._file, self._records)

    def _allocate_buffers(self) -> tuple[StagingBuffer, ...]:
        cfg = self.config
        return tuple(
            StagingBuffer.allocate(cfg.batch_slots, cfg.bytes_per_slot)
            for _ in range(cfg.num_buffers)
        )

    @property
    def path(self) -> str:
        """Return the path of the slot file."""
        return self._file.path

    @property
    def num_slots(self) -> int:
        """Return the number of slots of the tier."""
        return self.config.num_slots

    @property
    def batch_slots(self) -> int:
        """Return the slots per staging buffer."""
        return self.config.batch_slots

    @property
    def persistent(self) -> bool:
        """Return True when the tier keeps its file and manifest across runs."""
        return self.config.fingerprint is not None

    def recovered_slots(self) -> list[tuple[int, SlotRecord]]:
        """Return the `(slot, record)` pairs a persistent tier recovered at open, by slot.

        A slot this run has since written (or queued a write of) is no longer listed: its
        bytes are not the recovered record's any more, and its checksum is the new one's,
        so a restore from a stale list would serve them under the old key."""
        return self._records.recovered_slots()

    def end_persistence(self) -> None:
        """Drop every manifest record and record nothing more in this run; idempotent, a
        no-op for a non-persistent tier (see `ManifestLog.end`, and its OSError).

        Call after a tier reset: the KV stored from now on may have been computed with
        other weights than the fingerprint names (weights updated in memory), and the
        engine cannot tell. Writes in flight are not recorded once this returns.
        RuntimeError once the tier is closed: the records it would drop stay on disk.
        """
        with self._open_for_records():
            self._records.end_persistence()

    def forget(self, slots: Sequence[int]) -> None:
        """Drop the manifest records of `slots` now (copies the scheduler dropped or never
        registered: a restart must not restore them); a no-op for a non-persistent tier
        or once persistence ended. Raises ValueError for a slot id out of range.

        The tombstones are durable (synced) when this returns: no crash brings the copies
        back. Call only for slots no queued write goes to: a write queued before this call
        could record them again. When the tombstones cannot be appended or synced (a
        failing disk), every record is dropped and nothing more is persisted in this run,
        as by `end_persistence` (and its OSError): the copies may be suspect. RuntimeError
        once the tier is closed: the records stay on disk, and a restart restores them.
        """
        with self._open_for_records():
            self._records.forget(self._slot_ids(slots))

    def prepare_overwrite(self, slots: Sequence[int]) -> None:
        """Tombstone the manifest records of `slots`, which a job is about to write (in one
        or more batches): its first write syncs them all before it writes, where each
        batch's write would otherwise sync its own slots' tombstones (see
        `disk_tier_records`). Same conditions and errors as `forget`, and RuntimeError once
        the tier is closed (as `write_slots`); a no-op for a non-persistent tier."""
        with self._open_for_records():
            self._records.prepare_overwrite(self._slot_ids(slots))

    def _slot_ids(self, slots: Sequence[int]) -> list[int]:
        """Return `slots` as ints (see `slot_id_list`)."""
        return slot_id_list(slots, self.num_slots)

    def check_records(self, records: Sequence[SlotRecord], context: str = "") -> None:
        """Raise ValueError (message prefixed by `context`) for a record a persistent tier
        cannot write to its manifest; a non-persistent tier ignores records."""
        self._records.check_records(records, context)

    def write_slots(
        self,
        buffer: StagingBuffer,
        slot_ids: np.ndarray,
        records: Sequence[SlotRecord] | None = None,
    ) -> Future[None]:
        """Queue writing rows `0..len(slot_ids)` of `buffer` to `slot_ids` (store I/O thread).

        The checksums are computed here, in the caller's thread, while the rows are still
        hot in its cache; the I/O thread only writes. The future raises DiskIOError on an
        I/O error or a short write; the slots are then invalid (a later load of them
        fails). Sorted slot ids make fewer, larger writes. `records` (one per slot) are
        appended to a persistent tier's manifest once the data is written (ValueError,
        nothing queued, for one it cannot hold: see `check_records`); a non-persistent
        tier ignores them. When this raises (a KeyboardInterrupt included), the write
        does not run unless the I/O thread had already started it.
        """
        self._check_batch(buffer, slot_ids)
        if records is not None and len(records) != len(slot_ids):
            raise ValueError(f"{len(records)} records for {len(slot_ids)} slots")
        if records is not None:  # one the manifest cannot hold would fail the group's commit
            self.check_records(records)
        sums = self._checksums.compute(buffer.memory, len(slot_ids))
        kept = self._records.kept(records)
        claim = Claim()
        # Counted before it is queued: the queue is not seen idle. The slots' recovered
        # records no longer describe them.
        self._records.queued(slot_ids.tolist())
        try:
            return self._store_io.submit(self._write, claim, buffer, slot_ids.copy(), sums, kept)
        except BaseException:
            # Not queued, or queued but its future lost to an interrupt (in `submit` or
            # just after): withdrawn and counted done here, unless the I/O thread already
            # started it and counts it itself. Counted once either way.
            if claim.take():
                self._records.write_done()
            raise

    def read_slots(self, buffer: StagingBuffer, slot_ids: np.ndarray) -> SlotRead:
        """Queue reading `slot_ids` into rows `0..len(slot_ids)` of `buffer` (load I/O thread).

        `SlotRead.result()` raises DiskIOError on an I/O error or a short read, and its
        subclass BadSlotsError, naming every such slot, when slots hold no valid data or
        do not match the checksum of their last successful write (the other slots of the
        read are then verified). The checksums are verified in the thread calling
        `result()`, so the I/O thread only reads.
        """
        self._check_batch(buffer, slot_ids)
        slot_ids = slot_ids.copy()
        future = self._load_io.submit(self._read, buffer, slot_ids)
        return SlotRead(future, functools.partial(self._verify, buffer, slot_ids))

    @contextlib.contextmanager
    def _open_for_records(self) -> Iterator[None]:
        """Refuse a manifest change once a close began (RuntimeError naming the tier);
        a close waits for one already running, which would otherwise reach a closed
        manifest and return as if its records were dropped."""
        with self._closing.working() as is_open:
            if not is_open:
                raise RuntimeError(f"disk tier {self.path} is closed")
            yield

    def _refuse_closed(self) -> None:
        if self._closing.is_closing:
            raise RuntimeError(f"disk tier {self.path} is closed")

    def _check_batch(self, buffer: StagingBuffer, slot_ids: np.ndarray) -> None:
        self._refuse_closed()
        check_slot_ids(slot_ids, self.num_slots)
        size = self.config.bytes_per_slot
        width = buffer.tensor.shape[1] if buffer.tensor.dim() == 2 else None
        if width != size or buffer.memory.nbytes != buffer.capacity * size:
            # Rows of another size would be read or written as the wrong slots.
            raise ValueError(
                f"staging buffer has {width}-byte rows, not the tier's {size}-byte slots"
            )
        if len(slot_ids) > buffer.capacity:
            raise ValueError(f"{len(slot_ids)} slots do not fit a {buffer.capacity}-slot buffer")

    def _write(
        self,
        claim: Claim,
        buffer: StagingBuffer,
        slot_ids: np.ndarray,
        sums: np.ndarray,
        records: tuple[SlotRecord, ...] | None,
    ) -> None:
        if not claim.take():
            return  # withdrawn by `write_slots`, which counted it done
        try:
            self._write_now(buffer, slot_ids, sums, records)
        finally:
            if self._records.write_done():
                self._records.commit()

    def _write_now(
        self,
        buffer: StagingBuffer,
        slot_ids: np.ndarray,
        sums: np.ndarray,
        records: tuple[SlotRecord, ...] | None,
    ) -> None:
        size = self.config.bytes_per_slot
        slots = slot_ids.tolist()
        self._records.prepare_write(slots)
        self._checksums.invalidate(slot_ids)
        # A failed write leaves its slots invalid and without records: `prepare_write`
        # dropped them, durably, and a slot gets one only once this thread wrote it.
        for a, b in consecutive_runs(slot_ids):
            self._file.write(buffer.memory[a * size : b * size], int(slot_ids[a]))
        self._checksums.written(slot_ids, sums)
        self._records.written(slots, sums, records)  # appended at the group's commit

    def _read(self, buffer: StagingBuffer, slot_ids: np.ndarray) -> None:
        size = self.config.bytes_per_slot
        for a, b in consecutive_runs(slot_ids):
            self._file.read(buffer.memory[a * size : b * size], int(slot_ids[a]))

    def _verify(self, buffer: StagingBuffer, slot_ids: np.ndarray) -> None:
        """Check every slot of a finished read; raise BadSlotsError naming all bad ones."""
        problems, mismatched = self._checksums.find_bad(buffer.memory, slot_ids)
        self._records.forget_bad(mismatched)  # a restart must not offer them again
        if problems:
            raise bad_slots_error(problems, self.path)

    def check_invariants(self) -> None:
        """Raise AssertionError if the file or buffers disagree with the configuration."""
        cfg = self.config
        log = self._records.log
        if self._closing.is_closed:
            assert not self._file.is_open, "closed disk tier still holds its file"
            assert log is None or not log.is_open, "closed tier's manifest is open"
            return
        assert (log is not None) == self.persistent, "manifest without persistence"
        assert log is None or log.is_open, "open persistent tier without manifest"
        assert self._file.file_size() == cfg.num_slots * cfg.bytes_per_slot, "file size drifted"
        sums, valid = self._checksums.sums, self._checksums.valid
        assert sums.shape == valid.shape == (cfg.num_slots,)
        self._records.check(valid, sums)
        for buffer in (*self.store_buffers, *self.load_buffers):
            assert buffer.tensor.shape == (cfg.batch_slots, cfg.bytes_per_slot)
            assert buffer.tensor.data_ptr() % DIRECT_IO_ALIGNMENT == 0, "unaligned staging buffer"
            assert buffer.memory.nbytes == buffer.tensor.numel()

    def close(self) -> None:
        """Finish queued I/O, then close the file and remove it (a persistent tier syncs
        the slot file, then the manifest, and keeps both); idempotent. A tier collected
        without `close()` closes its files the same way, with a `ResourceWarning`.

        Any thread may call it, concurrently too: each call returns once the tier is
        closed (see `CloseGate`), except a call from one of the tier's I/O threads (a
        future's done-callback), which cannot wait for itself: it refuses new I/O, hands
        the close to a new thread and returns at once.

        A failed sync does not raise: it is logged as an error naming the file, the
        manifest is removed (the next run starts empty instead of offering slots whose
        bytes may not have reached the device), and both files are closed and the lock
        released all the same. Nor does a slot file that cannot be removed: it is left,
        with a warning naming it (see `SlotFile.close`). A close cut short by an interrupt
        (KeyboardInterrupt) is finished by the next call; one in the slot file's sync still
        syncs and closes the manifest before it is raised.
        """
        if self.is_io_thread(threading.current_thread()):
            self._close_elsewhere()
        else:
            self._closing.run(self._close_now)

    def is_io_thread(self, thread: threading.Thread) -> bool:
        """Return True if `thread` is one of the tier's I/O threads."""
        return thread in self._io_threads

    def _close_elsewhere(self) -> None:
        if self._closing.is_closed:
            return
        self._closing.mark_closing()
        # Not a daemon (as the I/O thread is): the interpreter waits for it before exiting.
        closer = threading.Thread(target=self.close, name="kvtier-disk-close", daemon=False)
        try:
            closer.start()
        except RuntimeError:  # interpreter exiting: the finalizer closes the files at exit
            logger.warning("disk tier %s: cannot close it from its own I/O thread", self.path)

    def _close_now(self) -> None:
        """Wait for the I/O threads, then close the files; safe to repeat."""
        self._store_io.shutdown()
        self._load_io.shutdown()
        if self._finalizer.alive:  # detached last: a close cut short is finished by a retry
            self._records.commit()  # the I/O threads are done: nothing else commits or writes
            close_files(self._file, self._records.log)
            self._finalizer.detach()
