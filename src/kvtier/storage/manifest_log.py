"""The open manifest (see `manifest`): an append-only log of put and tombstone records,
written from any thread, that compacts itself when it has grown (see
`manifest_compaction`)."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.offload.plan import SlotRecord
from kvtier.storage.close_gate import CloseGate
from kvtier.storage.file_lock import unlink_quietly
from kvtier.storage.manifest_compaction import (
    COMPACT_FLOOR,
    compaction_due,
    rewrite_manifest,
    sync_directory,
)
from kvtier.storage.manifest_format import ManifestEntry, encode_put, encode_tombstone

__all__ = ["ManifestLog"]

logger = logging.getLogger(__name__)


class ManifestLog:
    """The open manifest, appended to from any thread.

    Appends are best effort: an append that fails is cut off the file again (or, when even
    that fails, the log stops appending for the rest of the run, with a warning). Either
    way a read never returns wrong bytes; at worst a restart misses or fails a slot.

    Appends are not synced one by one: `sync()` makes every record appended so far
    durable (one fsync, for all of them), and `close()` syncs the rest. The disk tier
    syncs the tombstones before a write overwrites slots (see `disk_tier_records`).

    The log keeps the encoded put record of every live slot (about 180 B of memory per
    live slot with 36-byte keys: ~90 MB for 500k) and counts the records in its file; an
    append after which `compaction_due` holds rewrites the file with the live records
    (see `manifest_compaction`; `compactions` counts these). The rewrite runs under the lock
    that serializes appends, so no record is lost or lands in the replaced file; the cost
    is that an I/O thread appending meanwhile waits for one write and fsync of the
    compacted file (100k live slots: ~6 MB, typically tens of milliseconds on an SSD),
    which happens only after the log has grown to several times its compacted size. A
    failed rewrite is logged, and retried once the log has doubled in records.

    Once closed, calls return without taking that lock: a close cut short by an interrupt
    (KeyboardInterrupt) as it releases the lock may leave it taken (see `_close_now`).
    """

    def __init__(
        self,
        path: str,
        header: bytes,
        live: Mapping[int, ManifestEntry],
        compact_floor: int = COMPACT_FLOOR,
    ) -> None:
        """Write the manifest at `path` anew (header and one put record per `live` slot,
        atomically) and open it for appending; raise OSError naming the file when that
        fails (see `rewrite_manifest`)."""
        self.path = path
        self._header = header
        self._live = {slot: encode_put(slot, live[slot]) for slot in sorted(live)}
        self._compact_floor = compact_floor
        self._fd: int | None = None
        self._closing_fd: _Descriptor | None = None  # taken by `close()`, not closed yet
        self._size = self._records = self._retry_at = self.compactions = 0
        self._appends = self._synced = 0  # appends so far, and how many of them are synced
        self._tombstoned = 0  # the append count when a tombstone was last appended
        self.syncs = 0  # fsyncs `sync()` made (tests and benchmarks count them)
        self._broken = False
        # The last rewrite's rename is not durable (its directory's fsync failed): a crash
        # may bring the replaced log back, without the records appended since.
        self._unnamed = False
        # An fsync of the log failed outside `sync()` (a compaction's): Linux reports a
        # failed writeback once and may drop its pages, so a later fsync that succeeds
        # does not make the records appended before it durable.
        self._sync_failed = False
        self._ended = False  # `end()`: records nothing more in this run
        self._drop_failed = False  # `end()` could neither empty nor remove the file
        self._lock = threading.Lock()
        self._closing = CloseGate()
        self._rewrite()

    @property
    def is_open(self) -> bool:
        """Return True until `close()`."""
        return self._fd is not None

    def put(
        self, slots: Sequence[int], checksums: Sequence[int], records: Sequence[SlotRecord]
    ) -> None:
        """Append one put record per slot (call after the slots' data was written)."""
        encoded = [
            (int(slot), encode_put(int(slot), ManifestEntry(int(checksum), record)))
            for slot, checksum, record in zip(slots, checksums, records, strict=True)
        ]
        data = b"".join(record for _, record in encoded)
        if self._fd is None:  # closed: see the class
            return
        with self._lock:
            if self._append_locked(data, len(encoded)):
                self._live.update(encoded)  # in order: the last record of a slot wins
                self._compact_if_due()

    def forget(self, slots: Iterable[int]) -> bool:
        """Append a tombstone for each slot whose last record is a put; return False when
        the tombstones could not be appended (their puts are still in the file)."""
        if self._fd is None:  # closed: see the class
            return not any(int(slot) in self._live for slot in slots)
        with self._lock:
            dead = [s for s in dict.fromkeys(int(s) for s in slots) if s in self._live]
            if not dead:
                return True
            if not self._append_locked(b"".join(map(encode_tombstone, dead)), len(dead)):
                return False
            self._tombstoned = self._appends
            for slot in dead:
                del self._live[slot]
            self._compact_if_due()
            return True

    @property
    def ended(self) -> bool:
        """Return True once `end()` was called."""
        return self._ended

    def end(self) -> None:
        """Drop every record and record nothing more in this run (a tier reset: the KV
        stored from now on, and what the log describes, may be of other weights than
        the fingerprint names); idempotent.

        The file is rewritten atomically with the header alone (fsynced, see
        `rewrite_manifest`), under the lock that serializes appends: a put of a write
        still in flight lands in the replaced file or is dropped, never in the new one.
        When the rewrite fails, or its rename cannot be made durable (a crash would bring
        the old records back), the manifest is removed instead (the next open starts
        empty); when that fails too, OSError naming the file is raised and `close()`
        raises too, so that the tier's close removes the manifest then (see
        `disk_tier_close`). Appends stop either way.
        """
        if self._fd is None:  # closed: see the class
            self._ended = True
            self._live.clear()
            return
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self._live.clear()
            if self._fd is None:
                return
            try:
                fd = rewrite_manifest(self.path, self._header, durable_rename=True)
            except OSError as exc:
                self._remove_after(exc)
                return
            old, self._fd = self._fd, fd
            self._size, self._records = len(self._header), 0
            self._synced = self._appends  # the rewrite was synced
            self._unnamed = False  # and its rename too
            os.close(old)

    def _remove_after(self, exc: OSError) -> None:
        """Remove the manifest whose emptying rewrite failed with `exc` (lock held),
        durably: until its directory is synced, a crash may bring the file back, with
        the records `end()` was to drop (a copy `forget` let go among them)."""
        try:
            unlink_quietly(self.path)
            sync_directory(self.path)
        except OSError as unlink_exc:
            self._drop_failed = True  # `close` raises: the tier's close removes it then
            raise OSError(
                unlink_exc.errno,
                f"cannot drop the manifest's records ({exc}) nor remove it ({unlink_exc})",
                self.path,
            ) from exc
        logger.warning("disk tier manifest %s: cannot empty it (%s); removed it", self.path, exc)

    def _append_locked(self, data: bytes, num_records: int) -> bool:
        if self._fd is None or self._broken or self._ended:
            return False
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write: {written} of {len(data)} B")
        except OSError as exc:
            self._undo(exc)
            return False
        self._size += len(data)
        self._records += num_records
        self._appends += 1
        return True

    def sync(self, tombstones_only: bool = False) -> bool:
        """Make every record appended so far durable (fsync), unless none was appended
        since the last sync (`tombstones_only`: no tombstone); return False, with a
        warning, when the fsync fails, and from then on once a compaction's fsync failed
        (the records it was to make durable may be lost, and a later fsync succeeds).

        The fsync runs on a duplicate of the descriptor, outside the lock, so appends
        from other threads do not wait for it (records they append meanwhile are synced
        by the next call). A compaction or `end()` meanwhile rewrote the file and synced
        it itself; the duplicate then syncs the replaced file, which harms nothing. A
        rewrite whose rename is not durable yet (`_rewrite`) has its directory synced
        first, under the lock: until then a crash may bring the replaced log back without
        the records this call is to make durable.
        """
        if self._fd is None:  # closed: see the class
            return True
        try:
            with self._lock:
                newest = self._tombstoned if tombstones_only else self._appends
                if self._fd is None or newest <= self._synced:
                    return True
                if self._sync_failed:
                    raise OSError(errno.EIO, "an earlier fsync of it failed")
                if self._unnamed:
                    sync_directory(self.path)
                    self._unnamed = False
                target = self._appends
                fd = os.dup(self._fd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("disk tier manifest %s: cannot sync it (%s)", self.path, exc)
            return False
        with self._lock:
            self._synced = max(self._synced, target)
            self.syncs += 1
        return True

    def _undo(self, exc: OSError) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as undo_exc:
            self._broken = True
            logger.warning(
                "disk tier manifest %s: append failed (%s) and cannot be undone (%s); "
                "recording nothing more in this run",
                self.path,
                exc,
                undo_exc,
            )
            return
        logger.warning("disk tier manifest %s: append failed (%s); record dropped", self.path, exc)

    def _compact_if_due(self) -> None:
        if self._records < self._retry_at or not compaction_due(
            self._records, len(self._live), self._compact_floor
        ):
            return
        try:
            self._rewrite()
        except OSError as exc:
            self._retry_at = 2 * self._records
            logger.warning(
                "disk tier manifest %s: compaction failed (%s); appending to the old log",
                self.path,
                exc,
            )

    def _rewrite(self) -> None:
        """Replace the file with the header and the live records and append to it from
        now on (the caller holds the lock, or is the constructor).

        Tombstones the old log holds unsynced are synced first: should a crash undo the
        rename (its directory's fsync failed), the old log comes back with them, and no
        record `forget` or an overwrite dropped is live again."""
        if self._fd is not None and self._tombstoned > self._synced:
            try:
                os.fsync(self._fd)
            except OSError:
                self._sync_failed = True  # `sync()` and `close()` fail from now on
                raise
        content = self._header + b"".join(self._live.values())
        fd = rewrite_manifest(self.path, content)
        old, self._fd = self._fd, fd
        self._size, self._records = len(content), len(self._live)
        self._synced = self._appends  # the rewrite was synced, and holds every live record
        try:
            sync_directory(self.path)
            self._unnamed = False
        except OSError as exc:  # `sync()` and `close()` try again before they rely on it
            self._unnamed = True
            logger.warning("disk tier manifest %s: cannot sync its directory: %s", self.path, exc)
        if old is not None:
            self.compactions += 1
            os.close(old)  # the replaced log: no longer reachable by its path

    def close(self) -> None:
        """Flush the log to the device and close it; idempotent. Concurrent calls each
        return once the log is flushed and closed (see `CloseGate`).

        Raises OSError naming the manifest when the flush fails; the log is closed anyway
        (a later call returns quietly). A close cut short by an interrupt
        (KeyboardInterrupt) before its descriptor was closed is finished by the next call,
        from any thread; one cut short in the flush itself (`os.fsync`, `sync_directory`)
        has closed the descriptor on the way out, and the flush is not redone.
        """
        self._closing.run(self._close_now)

    def _close_now(self) -> None:
        # The descriptor stays in `_closing_fd` until it is closed, so that a close cut short
        # by an interrupt (KeyboardInterrupt) before that is finished by the next call, from
        # any thread. That call takes no lock: one cut short as its `with` exits (before
        # `__exit__` runs) leaves the lock taken for good.
        if self._fd is not None:
            with self._lock:  # appends in flight finish first
                self._closing_fd, self._fd = _Descriptor.of(self._fd), None
        closing = self._closing_fd
        if closing is None or not closing.is_open():  # closed already
            self._closing_fd = None
            return
        fd = closing.fd
        try:
            if self._drop_failed:
                raise OSError(errno.EIO, "its records could not be dropped at a reset")
            if self._sync_failed and not self._ended:  # `end()` rewrote or removed it
                raise OSError(errno.EIO, "an earlier fsync of it failed")
            os.fsync(fd)
            if self._unnamed:  # or a crash may bring the replaced log back
                sync_directory(self.path)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot sync the manifest: {exc.strerror or exc}", self.path
            ) from exc
        finally:
            os.close(fd)
            self._closing_fd = None  # once closed: a call cut short between finds it closed


@dataclass(frozen=True, slots=True)
class _Descriptor:
    """A descriptor and the file it is open on: a close cut short right after closing it
    can tell that the number is closed, or open on another file, and must not close it
    again."""

    fd: int
    dev: int
    ino: int

    @classmethod
    def of(cls, fd: int) -> _Descriptor:
        """Return `fd` with the file it is open on now."""
        info = os.fstat(fd)
        return cls(fd, info.st_dev, info.st_ino)

    def is_open(self) -> bool:
        """Return True while `fd` is open on that file."""
        try:
            info = os.fstat(self.fd)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == (self.dev, self.ino)
