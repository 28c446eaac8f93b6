"""The persistent disk tier's durability order (see `disk_tier`): a put record reaches
the manifest only after its slot's data was synced, a tombstone is synced before the
slot it dropped is overwritten, and a clean close syncs the slot file, then the manifest.

The order is observed by recording, per file, the writes and syncs the tier makes
(`os.pwrite`, `os.write`, `os.fsync`, `os.fdatasync`)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from storage_helpers import FlakyIO

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, DiskTier, DiskTierConfig
from kvtier.storage.slot_file import DiskIOError

SLOT = 4096

pytestmark = pytest.mark.timeout(60)

Event = tuple[str, str]  # (call, "slots" | "manifest")


def rec(i: int) -> SlotRecord:
    return SlotRecord(int(i).to_bytes(4, "little") * 9, 4)


def tier_config(tmp_path: Path) -> DiskTierConfig:
    return DiskTierConfig(
        str(tmp_path / "rank0.slots"),
        num_slots=16,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        fingerprint="fp",
    )


def record_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Event]:
    """Record from now on each write and sync of the tier's slot file or manifest (a
    duplicate descriptor counts as its file), in call order."""
    events: list[Event] = []
    names = {"rank0.slots": "slots", "rank0.manifest": "manifest"}

    def which(fd: int) -> str | None:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        name = os.path.basename(target)
        return names.get(name) if target.startswith(str(tmp_path)) else None

    def wrap(call: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(fd: int, *args: Any) -> Any:
            result = real(fd, *args)
            name = which(fd)
            if name is not None:
                events.append((call, name))
            return result

        return recorded

    for call in ("pwrite", "write", "fsync", "fdatasync"):
        monkeypatch.setattr(os, call, wrap(call, getattr(os, call)))
    return events


def is_sync(event: Event, name: str) -> bool:
    return event[1] == name and event[0] in ("fsync", "fdatasync")


def test_put_records_are_appended_only_after_their_data_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch: the slot file is synced between its data writes and its put records."""
    tier = DiskTier(tier_config(tmp_path))
    events = record_calls(monkeypatch, tmp_path)
    for first in (1, 5):
        slots = np.arange(first, first + 3, dtype=np.int64)
        tier.write_slots(tier.store_buffers[0], slots, [rec(s) for s in slots]).result()
    monkeypatch.undo()
    appends = [i for i, event in enumerate(events) if event == ("write", "manifest")]
    assert len(appends) == 2, events
    for append in appends:
        data = max(i for i in range(append) if events[i] == ("pwrite", "slots"))
        assert any(is_sync(e, "slots") for e in events[data:append]), events
    tier.close()
    restarted = DiskTier(tier_config(tmp_path))
    assert [slot for slot, _ in restarted.recovered_slots()] == [1, 2, 3, 5, 6, 7]
    restarted.close()


def test_tombstones_are_synced_before_their_slots_are_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`forget`'s tombstones, and those of a write without records, are durable before
    the write's data lands: a crash cannot bring a dropped record back over new bytes."""
    tier = DiskTier(tier_config(tmp_path))
    slots = np.arange(1, 4, dtype=np.int64)
    tier.write_slots(tier.store_buffers[0], slots, [rec(s) for s in slots]).result()
    events = record_calls(monkeypatch, tmp_path)
    tier.forget([2])
    tier.write_slots(tier.store_buffers[0], np.array([2], dtype=np.int64), [rec(9)]).result()
    tier.write_slots(tier.store_buffers[0], np.array([3], dtype=np.int64)).result()
    monkeypatch.undo()
    data_writes = [i for i, event in enumerate(events) if event == ("pwrite", "slots")]
    tombstones = [i for i, event in enumerate(events) if event == ("write", "manifest")]
    assert len(data_writes) == 2, events
    # forget's tombstone, the put of slot 2, the tombstone of slot 3 (a write without records)
    assert len(tombstones) == 3, events
    for tombstone, data in ((tombstones[0], data_writes[0]), (tombstones[2], data_writes[1])):
        assert tombstone < data, events
        assert any(is_sync(e, "manifest") for e in events[tombstone:data]), events
    tier.close()


def test_a_clean_close_syncs_the_slot_file_then_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the last batch's records, close syncs the data, then the manifest."""
    tier = DiskTier(tier_config(tmp_path))
    events = record_calls(monkeypatch, tmp_path)
    slots = np.arange(1, 3, dtype=np.int64)
    tier.write_slots(tier.store_buffers[0], slots, [rec(s) for s in slots]).result()
    tier.forget([1])
    tier.close()
    monkeypatch.undo()
    last_append = max(i for i, event in enumerate(events) if event == ("write", "manifest"))
    after = events[last_append:]
    data_sync = next(i for i, event in enumerate(after) if is_sync(event, "slots"))
    assert any(is_sync(event, "manifest") for event in after[data_sync:]), events
    restarted = DiskTier(tier_config(tmp_path))
    assert [slot for slot, _ in restarted.recovered_slots()] == [2]
    restarted.close()


def test_a_failed_manifest_sync_drops_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tombstone that cannot be synced before its slot is overwritten ends
    persistence for the run: the restart restores nothing."""
    config = tier_config(tmp_path)
    tier = DiskTier(config)
    slots = np.arange(1, 4, dtype=np.int64)
    tier.write_slots(tier.store_buffers[0], slots, [rec(s) for s in slots]).result()
    tier.forget([2])  # synced at once
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".manifest"):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", failing_fsync)
        # slot 1 is reused for another block: its old record's tombstone is not durable
        tier.write_slots(tier.store_buffers[0], np.array([1], dtype=np.int64), [rec(9)]).result()
    tier.close()
    restarted = DiskTier(config)
    assert restarted.recovered_slots() == []
    restarted.close()


class FailingWriteIO(FlakyIO):
    """Real I/O until `events` is set; then each data write is noted there and fails."""

    events: list[Event] | None = None

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if self.events is None:
            return super().pwrite(fd, data, offset)
        self.events.append(("failed pwrite", "slots"))
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_the_tombstones_of_a_failed_write_are_synced_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails may have overwritten part of its slots: their records were
    dropped, durably, before its first byte was written (so nothing is left to drop when
    it fails), and a restart offers neither slot."""
    io = FailingWriteIO()
    tier = DiskTier(tier_config(tmp_path), io)
    slots = np.arange(1, 3, dtype=np.int64)
    tier.write_slots(tier.store_buffers[0], slots, [rec(s) for s in slots]).result()
    events = io.events = record_calls(monkeypatch, tmp_path)
    with pytest.raises(DiskIOError):
        tier.write_slots(tier.store_buffers[0], slots, [rec(s) for s in slots]).result()
    monkeypatch.undo()
    # the tombstones of slots 1 and 2 (one append), then its sync, then the failed write
    assert events[0] == ("write", "manifest"), events
    assert is_sync(events[1], "manifest"), events
    assert events[2:] == [("failed pwrite", "slots")], events
    tier.close()
    restarted = DiskTier(tier_config(tmp_path))
    assert restarted.recovered_slots() == []
    restarted.close()
