"""Compaction of the manifest during a run: when it happens, what it keeps, and that a
failure or a crash in the middle of it leaves a manifest that recovers."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, DiskTier, DiskTierConfig, ManifestIdentity, SlotFile
from kvtier.storage.manifest import ManifestLog, open_manifest, read_manifest
from kvtier.storage.manifest_compaction import COMPACT_FLOOR, COMPACT_RATIO, compaction_due

SLOT = 4096
IDENTITY = ManifestIdentity("model-a|kv|sha256:0", 64, SLOT, "kv:4096")
KEY_BYTES = 36
RECORD_BYTES = 19 + KEY_BYTES + 8
HEADER = len(IDENTITY.encode())

pytestmark = pytest.mark.timeout(60)

Live = dict[int, tuple[int, SlotRecord]]


def rec(i: int) -> SlotRecord:
    return SlotRecord(i.to_bytes(4, "little") * (KEY_BYTES // 4), i % 1000)


def open_log(tmp_path: Path, compact_floor: int = COMPACT_FLOOR) -> tuple[SlotFile, ManifestLog]:
    slot_file = SlotFile(
        str(tmp_path / "kvtier-rank0.slots"),
        IDENTITY.num_slots,
        SLOT,
        DiskIOMode.PAGE_CACHE,
        persistent=True,
    )
    log, _ = open_manifest(slot_file, IDENTITY, compact_floor)
    return slot_file, log


def reopen(tmp_path: Path) -> Live:
    """Open the closed files again (a restart), close them, and return what was recovered."""
    path = str(tmp_path / "kvtier-rank0.slots")
    slot_file = SlotFile(path, IDENTITY.num_slots, SLOT, DiskIOMode.PAGE_CACHE, persistent=True)
    assert slot_file.reused
    log, live = open_manifest(slot_file, IDENTITY)
    log.close()
    slot_file.close()
    return {slot: (entry.checksum, entry.record) for slot, entry in live.items()}


def close(slot_file: SlotFile, log: ManifestLog) -> None:
    log.close()
    slot_file.close()


def manifest(tmp_path: Path) -> Path:
    return tmp_path / "kvtier-rank0.manifest"


def put(log: ManifestLog, expected: Live, slot: int, value: int) -> None:
    log.put([slot], [value], [rec(value)])
    expected[slot] = (value, rec(value))


def test_trigger_rule() -> None:
    """More than COMPACT_RATIO records per live slot, and more than the floor."""
    assert COMPACT_RATIO == 4
    assert not compaction_due(COMPACT_FLOOR, 16)
    assert compaction_due(COMPACT_FLOOR + 1, 16)
    assert compaction_due(COMPACT_FLOOR + 1, 0)
    assert not compaction_due(40_000, 10_000)
    assert compaction_due(40_001, 10_000)
    assert compaction_due(9, 2, floor=8)


def test_many_puts_to_few_slots_keep_the_file_small(tmp_path: Path) -> None:
    """50k puts to 16 slots: without compaction 3 MB, with it at most the floor's worth;
    a restart recovers the last record of every slot."""
    slot_file, log = open_log(tmp_path)
    expected: Live = {}
    largest = 0
    for i in range(50_000):
        put(log, expected, i % 16, i)
        if i % 997 == 0:
            largest = max(largest, manifest(tmp_path).stat().st_size)
    assert log.compactions >= 50_000 // (COMPACT_FLOOR + 1)
    largest = max(largest, manifest(tmp_path).stat().st_size)
    assert largest <= HEADER + (COMPACT_FLOOR + 1) * RECORD_BYTES
    assert not Path(f"{manifest(tmp_path)}.tmp").exists()
    close(slot_file, log)
    assert reopen(tmp_path) == expected
    assert manifest(tmp_path).stat().st_size == HEADER + 16 * RECORD_BYTES


def test_compaction_keeps_the_last_put_of_live_slots_only(tmp_path: Path) -> None:
    """Right after a compaction the file is the header and one put per live slot; a
    tombstoned slot is gone; later appends land in the new file and survive a reopen."""
    slot_file, log = open_log(tmp_path, compact_floor=20)
    expected: Live = {}
    for i in range(12):
        put(log, expected, i % 6, 100 + i)  # slots 0..5, twice each: 12 records
    log.forget([1, 3, 3, 40])  # two tombstones (duplicates, and a slot without a record)
    del expected[1], expected[3]
    assert log.compactions == 0
    old_inode = os.stat(manifest(tmp_path)).st_ino
    for i in range(7):  # records 15..21: compaction after the 21st
        put(log, expected, 2, 200 + i)
    assert log.compactions == 1
    assert os.stat(manifest(tmp_path)).st_ino != old_inode
    assert manifest(tmp_path).stat().st_size == HEADER + 4 * RECORD_BYTES
    live = read_manifest(str(manifest(tmp_path)), IDENTITY)
    assert {s: (e.checksum, e.record) for s, e in live.items()} == expected
    put(log, expected, 5, 300)
    log.forget([0])
    del expected[0]
    assert manifest(tmp_path).stat().st_size == HEADER + 5 * RECORD_BYTES + 27
    close(slot_file, log)
    assert expected == {2: (206, rec(206)), 4: (110, rec(110)), 5: (300, rec(300))}
    assert reopen(tmp_path) == expected


def test_records_rewritten_at_open_count_towards_the_next_compaction(tmp_path: Path) -> None:
    """The log counts the records of the file it appends to: the put records of the live
    slots that the open rewrote count too, so with 8 live slots and a floor of 20 the 25th
    append (33 records > 4 x 8) compacts, not the 33rd (SPEC §7: the file stays within
    COMPACT_RATIO times its compacted size)."""
    slot_file, log = open_log(tmp_path)
    expected: Live = {}
    for slot in range(8):
        put(log, expected, slot, slot)
    close(slot_file, log)
    slot_file, log = open_log(tmp_path, compact_floor=20)
    for i in range(24):
        put(log, expected, 0, 100 + i)
    assert log.compactions == 0
    put(log, expected, 0, 124)
    assert log.compactions == 1
    assert manifest(tmp_path).stat().st_size == HEADER + 8 * RECORD_BYTES
    close(slot_file, log)
    assert reopen(tmp_path) == expected


def test_failed_rename_keeps_appending_to_the_old_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """os.replace fails: a warning, no temporary file, the old log is still the manifest
    and receives the later records; compaction is retried once the log doubled."""
    slot_file, log = open_log(tmp_path, compact_floor=16)
    expected: Live = {}

    def refuse(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "injected rename failure")

    monkeypatch.setattr(os, "replace", refuse)
    with caplog.at_level(logging.WARNING):
        for i in range(17):
            put(log, expected, i % 2, i)
    assert "compaction failed" in caplog.text
    assert "injected rename failure" in caplog.text
    assert log.compactions == 0
    assert not Path(f"{manifest(tmp_path)}.tmp").exists()
    assert manifest(tmp_path).stat().st_size == HEADER + 17 * RECORD_BYTES
    monkeypatch.undo()
    for i in range(17, 33):  # the retry waits until the log holds 34 records
        put(log, expected, i % 2, i)
    assert log.compactions == 0
    assert manifest(tmp_path).stat().st_size == HEADER + 33 * RECORD_BYTES
    put(log, expected, 0, 33)
    assert log.compactions == 1
    assert manifest(tmp_path).stat().st_size == HEADER + 2 * RECORD_BYTES
    close(slot_file, log)
    assert reopen(tmp_path) == expected


class Crash(BaseException):
    """The process dies here."""


def test_crash_between_temp_file_and_rename_recovers_the_old_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the temporary file is complete, before the rename: the manifest is
    the complete old log; the leftover temporary file is ignored and removed at open."""
    slot_file, log = open_log(tmp_path, compact_floor=10)
    expected: Live = {}
    for i in range(10):
        put(log, expected, i % 2, i)
    tmp = Path(f"{manifest(tmp_path)}.tmp")
    leftover = tmp_path / "leftover"

    def crash(src: str, dst: str) -> None:
        shutil.copyfile(src, leftover)  # what a crash would leave behind
        raise Crash

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(Crash):
        put(log, expected, 1, 11)
    monkeypatch.undo()
    expected[1] = (11, rec(11))  # appended before the compaction started
    assert manifest(tmp_path).stat().st_size == HEADER + 11 * RECORD_BYTES
    assert leftover.stat().st_size == HEADER + 2 * RECORD_BYTES
    os.replace(leftover, tmp)
    close(slot_file, log)  # releases the lock, as the dead process would
    assert reopen(tmp_path) == expected
    assert not tmp.exists()


def test_concurrent_appends_during_compactions_lose_nothing(tmp_path: Path) -> None:
    """Four threads put and forget their own slots while the log compacts many times;
    every slot's final state is recovered."""
    slot_file, log = open_log(tmp_path, compact_floor=64)
    results: list[Live] = [{} for _ in range(4)]
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        mine = results[t]
        start.wait()
        for i in range(3000):
            slot = t + 4 * (i % 16)
            if i % 7 == 6:
                log.forget([slot])
                mine.pop(slot, None)
            else:
                put(log, mine, slot, t * 100_000 + i)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert log.compactions > 20
    expected = {slot: value for mine in results for slot, value in mine.items()}
    live = read_manifest(str(manifest(tmp_path)), IDENTITY)
    assert {s: (e.checksum, e.record) for s, e in live.items()} == expected
    close(slot_file, log)
    assert reopen(tmp_path) == expected


def test_disk_tier_store_thread_compacts_its_manifest(tmp_path: Path) -> None:
    """Stores with records through the tier's I/O thread: the manifest stays bounded and
    the reopened tier recovers and verifies the last write of every slot."""
    config = DiskTierConfig(
        str(tmp_path / "rank0.slots"),
        num_slots=16,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        fingerprint="fp",
    )
    tier = DiskTier(config)
    slots = np.arange(16, dtype=np.int64)
    buffer = tier.store_buffers[0]
    for round_ in range(300):  # 4800 records
        buffer.tensor[:16] = round_ % 256
        tier.write_slots(buffer, slots, [rec(round_ * 16 + s) for s in range(16)]).result()
    header = len(ManifestIdentity("fp", 16, SLOT).encode())
    assert (tmp_path / "rank0.manifest").stat().st_size < header + 1024 * RECORD_BYTES
    tier.close()
    tier = DiskTier(config)
    assert tier.recovered_slots() == [(s, rec(299 * 16 + s)) for s in range(16)]
    load = tier.load_buffers[0]
    tier.read_slots(load, slots).result()
    assert bool((load.tensor[:16] == 299 % 256).all())
    tier.close()
