"""The records of a disk tier (see `disk_tier`): those recovered at open, the put records
waiting for their group commit (`pending_puts`) and the manifest they are appended to.

A persistent tier (`DiskTierConfig.fingerprint` set) keeps its slot file and a manifest
(see `manifest`) across runs: at open it recovers the checksums and records of the live
slots, and it appends to the manifest as it goes. Every write tombstones the slots'
earlier records *before* writing (a slot reused for another block, or rewritten without
records), so a restart cannot offer them over the new bytes; a write with records then
appends one put record per slot after the slot's data is written. A write that fails
(its slots' old bytes may be partly overwritten) has nothing left to drop: its slots lost
their records, durably, before it began, and only the store I/O thread, after a write
succeeds, gives a slot a record. A read that fails verification tombstones the slot
(when that cannot be appended, persistence ends: the record would fail again after every
restart), and so does `forget` (copies the scheduler dropped, which may be suspect
although their bytes match their checksum: its tombstones are synced before it returns).

Durability, by group commit (see `pending_puts`): a written slot's put record waits,
with those of the other slots written meanwhile, until the store queue is idle (no other
write queued when a write ends), the group holds 64 MiB of slots, its oldest record
waited a second, or `close()`; then one `fdatasync` of the slot file makes their data
durable, and only then are the records appended, so a record is never in the manifest
before the data it describes is durable. A pending record whose slot is forgotten,
rewritten or fails is dropped, never appended. Before a batch overwrites any slot, the
manifest is synced if a tombstone was appended since its last sync (by a failed
verification, or this batch's own, for slots that held records), so a dropped record
cannot come back, after a crash, over the slot's new bytes: one manifest sync per batch
that overwrites recorded slots, none for a batch of free slots, and one per job when the
job tombstones all its slots before its first write (`DiskTier.prepare_overwrite`, as
the transfer worker's disk mover does). Put records are not synced as they are appended (a crash may
lose the newest ones, and the pending ones: a restart then misses those blocks, never
serves wrong bytes); `close()` commits the pending records, then syncs the slot file and
the manifest, so after a clean shutdown everything is durable. A failed manifest sync
drops every record and ends persistence for the run (as `forget` does when it cannot
append). `end_persistence()` (a tier reset) drops every record and records nothing more
in this run: the tier then works as a non-persistent one whose files are kept, and the
next open finds nothing to restore.

`DiskRecords` keeps this order; the tier calls it around each write (`queued`,
`prepare_write`, `written`, `write_done`, `commit`). A non-persistent tier's records
hold no manifest, and every call is then a no-op.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from kvtier.offload.plan import SlotRecord
from kvtier.storage.manifest import ManifestLog, check_record
from kvtier.storage.pending_puts import PendingPuts

__all__ = ["DiskRecords"]

logger = logging.getLogger(__name__)


class DiskRecords:
    """A disk tier's records: recovered, pending and in the manifest (`log`, None when
    the tier is not persistent). `path` names the tier in log messages."""

    def __init__(
        self,
        path: str,
        log: ManifestLog | None,
        pending: PendingPuts | None,
        recovered: dict[int, SlotRecord],
    ) -> None:
        self.path = path
        self.log = log
        self.pending = pending
        # Until this run writes the slot. Changed from the store I/O thread (`end`) as
        # well as the caller's: `_lock` keeps `recovered_slots` from iterating it meanwhile.
        self._recovered = recovered
        self._lock = threading.Lock()

    def recovered_slots(self) -> list[tuple[int, SlotRecord]]:
        """Return the recovered `(slot, record)` pairs, by slot (`DiskTier.recovered_slots`)."""
        with self._lock:
            items = list(self._recovered.items())
        return sorted(items)

    def end_persistence(self) -> None:
        """Drop every record and record nothing more (`DiskTier.end_persistence`)."""
        if self.log is None or self.log.ended:
            return
        self._drop_all(self.log)
        logger.info(
            "disk tier %s: a reset dropped the persistent cache; nothing more is persisted "
            "in this run (its KV may be of weights the fingerprint does not name)",
            self.path,
        )

    def forget(self, slots: Sequence[int]) -> None:
        """Drop the records of `slots`, ids in range, durably (`DiskTier.forget`): the
        tombstones are synced before this returns, so no crash brings back a copy the
        scheduler let go (its bytes may match their checksum and still be suspect)."""
        if self.log is None or self.log.ended or not slots:
            return
        if self._forget_slots(slots):
            self.sync_log()
            return
        self.end(f"cannot drop the manifest records of {len(slots)} slots the scheduler let go")

    def prepare_overwrite(self, slots: Sequence[int]) -> None:
        """Tombstone the records of `slots`, ids in range, which a job is about to write
        (`DiskTier.prepare_overwrite`); not synced here: the job's first write syncs them
        on the store I/O thread, before it writes (`prepare_write`), and its later writes
        find nothing to sync."""
        if self.log is None or self.log.ended or not slots or self._forget_slots(slots):
            return
        self.end(f"cannot drop the manifest records of {len(slots)} slots about to be rewritten")

    def forget_bad(self, slots: Sequence[int]) -> None:
        """Drop the records of `slots`, which failed their checksum, so a restart does not
        offer them again; never raises (the caller raises the read's error). Not synced:
        after a crash the record fails its check again, and the slot's next write syncs the
        tombstone first. When the tombstones cannot be appended, every record is dropped
        and nothing more is persisted in this run (`end`): the records would fail again
        after every restart. After `close()` (a read verified late) the manifest is left
        as it is, with a warning: the next run finds the records bad and drops them."""
        if self.log is None or self.log.ended or not slots or self._forget_slots(slots):
            return
        if not self.log.is_open:  # `end` would only forget them in memory
            logger.warning(
                "disk tier %s: %d slots failed their checksum after the tier closed: the "
                "manifest keeps their records, which the next run finds bad and drops",
                self.path,
                len(slots),
            )
            return
        try:
            self.end(
                f"cannot drop the manifest records of {len(slots)} slots that failed their checksum"
            )
        except OSError as exc:
            logger.error("disk tier %s: %s", self.path, exc)

    def _forget_slots(self, slots: Sequence[int]) -> bool:
        """Drop the recovered, the pending and the manifest records of `slots`; return
        False when the tombstones could not be appended (see `ManifestLog.forget`)."""
        if self.pending is None:
            return True
        with self._lock:
            for slot in slots:
                self._recovered.pop(slot, None)
        return self.pending.forget(slots)

    def end(self, why: str) -> None:
        """Drop every record and record nothing more in this run, with a warning: what
        the manifest holds after a failed append or sync is unknown."""
        if self.log is None:
            return
        self._drop_all(self.log)
        logger.warning(
            "disk tier %s: %s; dropped every record, and nothing more is persisted in this run",
            self.path,
            why,
        )

    def _drop_all(self, log: ManifestLog) -> None:
        """Forget the recovered and the pending records and end the manifest log."""
        with self._lock:
            self._recovered.clear()
        log.end()
        if self.pending is not None:
            self.pending.clear()

    def check_records(self, records: Sequence[SlotRecord], context: str = "") -> None:
        """Raise ValueError (message prefixed by `context`) for a record the manifest
        cannot hold; without a manifest, records are ignored."""
        if self.log is None:
            return
        for record in records:
            try:
                check_record(record)
            except ValueError as exc:
                raise ValueError(f"{context}{exc}") from exc

    def kept(self, records: Sequence[SlotRecord] | None) -> tuple[SlotRecord, ...] | None:
        """Return the records a write keeps for the manifest (None without one)."""
        return tuple(records) if records is not None and self.log is not None else None

    def queued(self, slots: Sequence[int]) -> None:
        """Note a write of `slots` about to be queued: their recovered records no longer
        describe them, and the store queue is not idle (see `PendingPuts.queued`)."""
        if self._recovered:
            with self._lock:
                for slot in slots:
                    self._recovered.pop(slot, None)
        if self.pending is not None:
            self.pending.queued()

    def write_done(self) -> bool:
        """Count a queued write as finished (or not queued after all); return True when
        the pending records are due for `commit` (see `PendingPuts.write_done`)."""
        return self.pending is not None and self.pending.write_done()

    def prepare_write(self, slots: Sequence[int]) -> None:
        """Drop the records that describe the bytes `slots` are about to lose (pending
        ones, and tombstones for those in the manifest, also when the write has records:
        its put records are appended only at the group's commit), and make the tombstones
        durable before the slots are overwritten: a crash before that commit leaves no
        record over the new bytes. A batch costs at most one manifest sync, and none when
        no overwritten slot holds a record (a first write, a slot forgotten before)."""
        if self.log is None:
            return
        assert self.pending is not None
        if not self.pending.forget(slots):  # the old records would describe new bytes
            self.end(f"cannot drop the manifest records of {len(slots)} slots being rewritten")
        self.sync_log()

    def written(
        self, slots: Sequence[int], sums: np.ndarray, records: tuple[SlotRecord, ...] | None
    ) -> None:
        """Hold the records of `slots`, just written, for the group's commit."""
        log, pending = self.log, self.pending
        if log is not None and pending is not None and records is not None and not log.ended:
            pending.add(slots, sums.tolist(), records)

    def commit(self) -> None:
        """Commit the pending records (see `PendingPuts.commit`); never raises: when the
        records cannot be dropped either, the tier's close removes the manifest."""
        if self.pending is None or self.pending.commit():
            return
        try:
            self.end("cannot drop the records of slots whose data failed to sync")
        except OSError as exc:
            logger.error("disk tier %s: %s", self.path, exc)

    def sync_log(self) -> None:
        """Sync the manifest when a tombstone was appended since its last sync
        (`ManifestLog.sync`); when that fails, end the records (`end`)."""
        log = self.log
        if log is None or log.ended or log.sync(tombstones_only=True):
            return
        self.end("cannot sync the manifest")

    def check(self, valid: np.ndarray, checksums: np.ndarray) -> None:
        """Raise AssertionError unless every pending record matches the slot's data."""
        if self.pending is not None:
            self.pending.check(valid, checksums)
