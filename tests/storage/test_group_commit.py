"""The persistent disk tier's group commit (see `disk_tier`, `pending_puts`): the put
records of writes queued back to back wait for one slot file sync and are appended
together once the store queue is idle; a pending record whose slot is forgotten,
rewritten or fails to sync is dropped, never appended."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from test_manifest_durability import is_sync, rec, record_calls, tier_config

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskTier
from kvtier.storage.manifest_format import ManifestEntry
from kvtier.storage.manifest_log import ManifestLog
from kvtier.storage.pending_puts import PendingPuts
from kvtier.storage.slot_file import SlotFile

pytestmark = pytest.mark.timeout(60)


class GatedWrites:
    """Hold the tier's slot writes: the n-th write (from 0) waits for `release(n)`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gated: int) -> None:
        self._gates = [threading.Event() for _ in range(gated)]
        self._count = 0
        real = SlotFile.write

        def write(slot_file: SlotFile, data: memoryview, first_slot: int) -> None:
            n, self._count = self._count, self._count + 1
            if n < len(self._gates):
                assert self._gates[n].wait(30), "a gated write was never released"
            real(slot_file, data, first_slot)

        monkeypatch.setattr(SlotFile, "write", write)

    def release(self, n: int) -> None:
        self._gates[n].set()


def one(slot: int) -> np.ndarray:
    return np.array([slot], dtype=np.int64)


def recovered(tmp_path: Path) -> list[tuple[int, SlotRecord]]:
    tier = DiskTier(tier_config(tmp_path))
    try:
        return tier.recovered_slots()
    finally:
        tier.close()


def test_writes_queued_back_to_back_share_one_sync_and_one_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(tier_config(tmp_path))
    gate = GatedWrites(monkeypatch, 1)
    events = record_calls(monkeypatch, tmp_path)
    buffers = tier.store_buffers
    first = tier.write_slots(buffers[0], np.arange(1, 3), [rec(1), rec(2)])
    second = tier.write_slots(buffers[1], np.arange(5, 7), [rec(5), rec(6)])
    gate.release(0)
    first.result()
    second.result()
    monkeypatch.undo()
    assert [e for e in events if is_sync(e, "slots")] == [("fdatasync", "slots")], events
    assert events.count(("write", "manifest")) == 1, events
    assert events.index(("fdatasync", "slots")) > max(
        i for i, event in enumerate(events) if event == ("pwrite", "slots")
    ), events
    tier.check_invariants()
    tier.close()
    assert [slot for slot, _ in recovered(tmp_path)] == [1, 2, 5, 6]


def test_a_pending_record_of_a_forgotten_slot_is_never_appended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`forget` between a write and its group's commit drops the write's record."""
    tier = DiskTier(tier_config(tmp_path))
    tier.write_slots(tier.store_buffers[0], one(1), [rec(100)]).result()  # committed
    gate = GatedWrites(monkeypatch, 2)
    first = tier.write_slots(tier.store_buffers[0], one(1), [rec(1)])
    second = tier.write_slots(tier.store_buffers[1], one(2), [rec(2)])
    gate.release(0)
    first.result()  # slot 1's new record waits: the second write is queued
    tier.check_invariants()
    tier.forget([1])
    gate.release(1)
    second.result()
    tier.close()
    assert recovered(tmp_path) == [(2, rec(2))]


def test_a_slot_rewritten_before_the_commit_keeps_only_its_newest_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(tier_config(tmp_path))
    gate = GatedWrites(monkeypatch, 1)
    events = record_calls(monkeypatch, tmp_path)
    first = tier.write_slots(tier.store_buffers[0], one(3), [rec(1)])
    rewrite = tier.write_slots(tier.store_buffers[1], one(3), [rec(2)])
    without_record = tier.write_slots(tier.store_buffers[0], one(4))
    gate.release(0)
    for future in (first, rewrite, without_record):
        future.result()
    monkeypatch.undo()
    assert events.count(("write", "manifest")) == 1, events  # slot 3's newest put only
    tier.close()
    assert recovered(tmp_path) == [(3, rec(2))]


def test_a_slot_written_without_record_drops_its_pending_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(tier_config(tmp_path))
    gate = GatedWrites(monkeypatch, 1)
    first = tier.write_slots(tier.store_buffers[0], np.arange(1, 3), [rec(1), rec(2)])
    unrecorded = tier.write_slots(tier.store_buffers[1], one(2))
    gate.release(0)
    first.result()
    unrecorded.result()
    tier.close()
    assert recovered(tmp_path) == [(1, rec(1))]


def test_a_failed_data_sync_drops_the_group_and_its_slots_older_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The bytes on the device are unknown after a failed `fdatasync`: neither the new
    records nor the older ones of the rewritten slots are offered after a restart."""
    tier = DiskTier(tier_config(tmp_path))
    tier.write_slots(tier.store_buffers[0], np.arange(1, 3), [rec(1), rec(2)]).result()

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(os, "fdatasync", failing)
        tier.write_slots(tier.store_buffers[0], one(1), [rec(9)]).result()  # no error raised
    assert "dropped the records of 1 written slots" in caplog.text
    tier.check_invariants()
    tier.close()
    assert recovered(tmp_path) == [(2, rec(2))]


def test_a_record_dropped_while_its_group_syncs_is_not_appended(tmp_path: Path) -> None:
    """The records are checked again after the sync, under the lock `forget` takes."""
    log = ManifestLog(str(tmp_path / "m.manifest"), b"header", {})
    pending: PendingPuts

    def sync_data() -> None:  # another thread forgets and rewrites slots meanwhile
        assert pending.forget([1])
        assert pending.forget([2])  # rewritten
        pending.add([2], [22], [rec(22)])

    pending = PendingPuts(log, sync_data, bytes_per_slot=4096)
    pending.add([1, 2, 3], [1, 2, 3], [rec(1), rec(2), rec(3)])
    assert pending.commit()
    assert len(pending) == 1  # slot 2's newer record, for the next commit
    assert log._live == {3: _put(3, 3, rec(3))}
    log.close()


def test_a_large_or_old_group_is_due_while_writes_are_queued(tmp_path: Path) -> None:
    log = ManifestLog(str(tmp_path / "m.manifest"), b"header", {})
    pending = PendingPuts(log, lambda: None, bytes_per_slot=4096, commit_bytes=2 * 4096)
    for _ in range(3):
        pending.queued()
    pending.add([1], [1], [rec(1)])
    assert not pending.write_done()  # two writes still queued, one slot pending
    pending.add([2], [2], [rec(2)])
    assert pending.write_done()  # two slots: the group is large enough
    assert pending.commit()
    assert len(pending) == 0
    aged = PendingPuts(log, lambda: None, bytes_per_slot=4096, commit_seconds=0.0)
    aged.queued()
    aged.queued()
    aged.add([3], [3], [rec(3)])
    assert aged.write_done()
    log.close()


def _put(slot: int, checksum: int, record: SlotRecord) -> bytes:
    from kvtier.storage.manifest_format import encode_put

    return encode_put(slot, ManifestEntry(checksum, record))
