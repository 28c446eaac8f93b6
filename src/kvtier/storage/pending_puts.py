"""The put records of a persistent disk tier that wait for their group commit (see
`disk_tier_records`): written slots whose records are appended to the manifest only after one
`fdatasync` of the slot file made their data, and the data of every other record in the
group, durable.

A pending record is dropped, never appended, once its slot is forgotten, rewritten or
failed: its data is no longer what it describes. The records of a group are checked
against the pending ones again after the sync, under the lock that also orders
`forget`'s tombstones, so a record dropped while the sync ran is not appended either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.offload.plan import SlotRecord
from kvtier.storage.manifest_log import ManifestLog

__all__ = ["COMMIT_BYTES", "COMMIT_SECONDS", "PendingPuts"]

logger = logging.getLogger(__name__)

COMMIT_BYTES = 64 << 20  # a group is committed once its slots hold this much data
COMMIT_SECONDS = 1.0  # ... or once its oldest record waited this long (a busy queue)


@dataclass(frozen=True, eq=False)
class _Pending:
    """One slot's record waiting for its commit; compared by identity."""

    checksum: int
    record: SlotRecord


class PendingPuts:
    """The records waiting for their commit, by slot; thread-safe.

    The store I/O thread adds records and commits them (`commit`); `forget` and `drop`
    may come from any thread. A commit that cannot sync the slot file drops its records
    and tombstones their slots' older records (the bytes on the device are unknown)."""

    def __init__(
        self,
        log: ManifestLog,
        sync_data: Callable[[], None],
        bytes_per_slot: int,
        commit_bytes: int = COMMIT_BYTES,
        commit_seconds: float = COMMIT_SECONDS,
    ) -> None:
        self._log = log
        self._sync_data = sync_data
        self._commit_slots = max(1, commit_bytes // bytes_per_slot)
        self._commit_seconds = commit_seconds
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._oldest: float | None = None  # when the oldest pending record was added
        self._queued = 0  # writes queued and not finished (`queued`, `write_done`)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def queued(self) -> None:
        """Count a write queued on the store I/O thread (before it is submitted)."""
        with self._lock:
            self._queued += 1

    def write_done(self) -> bool:
        """Count a queued write as finished; return True when the records are due: no
        other write is queued (the store queue is idle), or the group is large or old."""
        with self._lock:
            self._queued -= 1
            if not self._pending:
                return False
            assert self._oldest is not None
            return (
                self._queued == 0
                or len(self._pending) >= self._commit_slots
                or time.monotonic() - self._oldest >= self._commit_seconds
            )

    def add(
        self, slots: Sequence[int], checksums: Sequence[int], records: Sequence[SlotRecord]
    ) -> None:
        """Hold the records of slots whose data was just written."""
        with self._lock:
            for slot, checksum, record in zip(slots, checksums, records, strict=True):
                self._pending[int(slot)] = _Pending(int(checksum), record)
            if self._oldest is None and self._pending:  # a write of no slots adds none
                self._oldest = time.monotonic()

    def forget(self, slots: Sequence[int]) -> bool:
        """Drop the pending records of `slots` (forgotten, or about to be rewritten) and
        tombstone their manifest records (see `ManifestLog.forget`, whose result this
        returns)."""
        with self._lock:
            self._drop_locked(slots)
            return self._log.forget(slots)

    def clear(self) -> None:
        """Drop every pending record (persistence ended)."""
        with self._lock:
            self._pending.clear()
            self._oldest = None

    def commit(self) -> bool:
        """Sync the slot file, then append the records pending before the sync that still
        are; return False when their slots' older records could not be tombstoned after
        a failed sync (the caller ends persistence)."""
        with self._lock:
            if not self._pending:
                return True
            group = dict(self._pending)
        try:
            self._sync_data()
            failure = None
        except OSError as exc:
            failure = exc
        with self._lock:
            live = [(slot, p) for slot, p in group.items() if self._pending.get(slot) is p]
            self._drop_locked(slot for slot, _ in live)
            if failure is not None:
                logger.warning(
                    "disk tier manifest %s: dropped the records of %d written slots: %s",
                    self._log.path,
                    len(live),
                    failure,
                )
                return self._log.forget([slot for slot, _ in live])
            if live:
                self._log.put(
                    [slot for slot, _ in live],
                    [p.checksum for _, p in live],
                    [p.record for _, p in live],
                )
            return True

    def check(self, valid: np.ndarray, checksums: np.ndarray) -> None:
        """Raise AssertionError unless every pending slot holds valid data of its checksum
        and no queued write was counted done twice."""
        with self._lock:
            for slot, p in self._pending.items():
                assert valid[slot], f"pending record of slot {slot} without valid data"
                assert int(checksums[slot]) == p.checksum, f"pending record of slot {slot} stale"
            assert (self._oldest is None) == (not self._pending), "pending age out of step"
            assert self._queued >= 0, f"{-self._queued} queued writes counted done twice"

    def _drop_locked(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._pending.pop(int(slot), None)
        if not self._pending:
            self._oldest = None
