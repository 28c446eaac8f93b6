"""The manifest of a persistent disk tier: byte format, replay rules, open and compaction."""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash
from storage_helpers import WAIT_S, join_all, start_until_parked

from kvtier.offload.plan import SlotRecord
from kvtier.storage import (
    DiskIOMode,
    DiskTierBusyError,
    ManifestIdentity,
    SlotFile,
    manifest_path_for,
)
from kvtier.storage.manifest import ManifestLog, open_manifest, read_manifest, remove_manifest
from kvtier.storage.manifest_format import ManifestEntry, check_record, encode_put

SLOT = 4096
IDENTITY = ManifestIdentity("model-a|kv|sha256:0", 8, SLOT, "kv[0][K]:2048;kv[0][V]:2048")
KEY_BYTES = 36
RECORD_BYTES = 19 + KEY_BYTES + 8

pytestmark = pytest.mark.timeout(60)


def rec(i: int) -> SlotRecord:
    return SlotRecord(bytes([i]) * KEY_BYTES, 16 * i)


def open_tier_files(
    tmp_path: Path, identity: ManifestIdentity = IDENTITY
) -> tuple[SlotFile, ManifestLog, dict[int, tuple[int, SlotRecord]]]:
    slot_file = SlotFile(
        str(tmp_path / "kvtier-rank0.slots"),
        identity.num_slots,
        identity.bytes_per_slot,
        DiskIOMode.PAGE_CACHE,
        persistent=True,
    )
    log, live = open_manifest(slot_file, identity)
    return slot_file, log, {s: (e.checksum, e.record) for s, e in live.items()}


def close(slot_file: SlotFile, log: ManifestLog) -> None:
    log.close()
    slot_file.close()


def manifest_of(tmp_path: Path) -> Path:
    return Path(manifest_path_for(str(tmp_path / "kvtier-rank0.slots")))


def test_header_and_record_layout_match_the_documented_format(tmp_path: Path) -> None:
    """Header: magic, version, geometry, layout, fingerprint, checksum; records: kind,
    slot, tokens, data checksum, key, checksum; all little-endian."""
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {}
    assert manifest_of(tmp_path).name == "kvtier-rank0.manifest"
    log.put([3], [0xABCDEF], [rec(7)])
    log.forget([3])
    close(slot_file, log)
    data = manifest_of(tmp_path).read_bytes()
    layout, fingerprint = IDENTITY.region_layout.encode(), IDENTITY.fingerprint.encode()
    head = struct.pack("<8sIQQII", b"KVTMANI1", 1, 8, SLOT, len(layout), len(fingerprint))
    head += layout + fingerprint
    assert data[: len(head)] == head
    assert data[len(head) : len(head) + 8] == struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    records = data[len(head) + 8 :]
    assert len(records) == RECORD_BYTES + 27  # a put with a 36-byte key, a tombstone
    body = struct.pack("<BIIQH", 1, 3, 112, 0xABCDEF, KEY_BYTES) + rec(7).key
    assert records[:RECORD_BYTES] == body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    assert records[RECORD_BYTES] == 2  # tombstone kind
    assert read_manifest(str(manifest_of(tmp_path)), IDENTITY) == {}


def test_reopen_recovers_the_last_record_per_slot_and_compacts(tmp_path: Path) -> None:
    """Last record wins, tombstones forget; the reopened manifest holds live records only."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1, 2, 3], [11, 22, 33], [rec(1), rec(2), rec(3)])
    log.put([2], [222], [rec(9)])
    log.forget([3, 5])  # slot 5 has no record: no tombstone is written for it
    close(slot_file, log)
    header = len(IDENTITY.encode())
    assert manifest_of(tmp_path).stat().st_size == header + 4 * RECORD_BYTES + 27
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (11, rec(1)), 2: (222, rec(9))}
    assert slot_file.reused
    assert manifest_of(tmp_path).stat().st_size == header + 2 * RECORD_BYTES
    assert not Path(str(manifest_of(tmp_path)) + ".tmp").exists()
    close(slot_file, log)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"fingerprint": "model-b|kv|sha256:0"}, "fingerprint 'model-a"),
        ({"bytes_per_slot": 2 * SLOT}, "bytes_per_slot 4096 != 8192"),
        ({"region_layout": "kv[0]:4096"}, "region layout"),
    ],
)
def test_identity_mismatch_discards_both_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict[str, object], reason: str
) -> None:
    """Another fingerprint or geometry: a warning naming the reason and path, nothing
    recovered, a fresh slot file of the new size."""
    slot_file, log, _ = open_tier_files(tmp_path)
    slot_file.write(memoryview(b"\x5a" * SLOT), 1)
    log.put([1], [1], [rec(1)])
    close(slot_file, log)
    other = dataclasses.replace(IDENTITY, **change)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        slot_file, log, live = open_tier_files(tmp_path, other)
    assert live == {}
    assert not slot_file.reused
    assert reason in caplog.text
    assert str(tmp_path / "kvtier-rank0.slots") in caplog.text
    assert slot_file.file_size() == other.num_slots * other.bytes_per_slot
    out = bytearray(other.bytes_per_slot)
    slot_file.read(memoryview(out), 1)
    assert not any(out)  # the old bytes are gone
    close(slot_file, log)
    assert read_manifest(str(manifest_of(tmp_path)), other) == {}


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("magic", "bad magic"),
        ("version", "format version 7"),
        ("header_sum", "header checksum"),
        ("short_header", "shorter than its header"),
        ("missing", "manifest is missing"),
    ],
)
def test_damaged_files_are_discarded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, reason: str
) -> None:
    """Bad magic, version or header checksum, a cut header, no manifest, or a slot file of
    the wrong size: warning, nothing recovered, fresh files."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1], [1], [rec(1)])
    close(slot_file, log)
    path = manifest_of(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "magic":
        data[0] ^= 0xFF
    elif damage == "version":
        data[8:12] = struct.pack("<I", 7)
    elif damage == "header_sum":
        data[40] ^= 0x01  # inside the region layout
    elif damage == "short_header":
        data = data[:20]
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        slot_file, log, live = open_tier_files(tmp_path)
    assert live == {}
    assert reason in caplog.text
    assert slot_file.file_size() == 8 * SLOT
    close(slot_file, log)


def test_a_corrupt_middle_record_costs_only_that_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A flipped byte in the middle record: it is skipped with a warning saying how many
    bytes, and the records before and after it count (they used to be ignored too)."""
    slot_file, log, _ = open_tier_files(tmp_path)
    for slot in (1, 2, 3):
        log.put([slot], [slot], [rec(slot)])
    close(slot_file, log)
    path = manifest_of(tmp_path)
    data = bytearray(path.read_bytes())
    at = len(data) - 2 * RECORD_BYTES
    data[at + 25] ^= 0x04  # inside the key of the middle record
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (1, rec(1)), 3: (3, rec(3))}
    assert (
        f"corrupt record at byte {at} of {len(data)}; skipped {RECORD_BYTES} bytes to the "
        f"next valid record, at byte {at + RECORD_BYTES} (checksum mismatch)"
    ) in caplog.text
    close(slot_file, log)


@pytest.mark.parametrize("cut", [1, 8, RECORD_BYTES - 1])
def test_torn_last_record_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: int
) -> None:
    """A short tail (a record cut anywhere) is ignored with a warning."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1, 2], [1, 2], [rec(1), rec(2)])
    close(slot_file, log)
    path = manifest_of(tmp_path)
    os.truncate(path, path.stat().st_size - cut)
    with caplog.at_level(logging.WARNING):
        slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (1, rec(1))}
    assert "torn record" in caplog.text
    close(slot_file, log)


def test_failed_append_is_cut_off_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short append is truncated away; the log keeps working and replays cleanly."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1], [1], [rec(1)])
    size = manifest_of(tmp_path).stat().st_size
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:10]))
    log.put([2], [2], [rec(2)])
    monkeypatch.undo()
    assert manifest_of(tmp_path).stat().st_size == size
    log.put([3], [3], [rec(3)])
    close(slot_file, log)
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (1, rec(1)), 3: (3, rec(3))}
    close(slot_file, log)


def test_an_append_that_cannot_be_cut_off_stops_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A short append whose truncation fails too leaves a torn record in the file: the log
    appends nothing more for the rest of the run (it does not write on to a file it could
    not cut back; replay skips the torn bytes either way), and says so (SPEC §7)."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1], [1], [rec(1)])
    real_write = os.write

    def refuse(fd: int, length: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:10]))
    monkeypatch.setattr(os, "ftruncate", refuse)
    with caplog.at_level(logging.WARNING):
        log.put([2], [2], [rec(2)])
    monkeypatch.undo()
    assert "cannot be undone" in caplog.text
    size = manifest_of(tmp_path).stat().st_size
    log.put([3], [3], [rec(3)])
    log.forget([1])
    assert manifest_of(tmp_path).stat().st_size == size
    close(slot_file, log)


def test_lock_refuses_a_second_opener_and_touches_nothing(tmp_path: Path) -> None:
    """While one SlotFile holds the lock, another (persistent or not) fails; files stay."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1], [1], [rec(1)])
    before = manifest_of(tmp_path).read_bytes()
    other = ManifestIdentity("model-b", 8, SLOT)
    with pytest.raises(DiskTierBusyError, match="locked by another") as info:
        open_tier_files(tmp_path, other)
    assert info.value.filename == str(tmp_path / "kvtier-rank0.slots")
    assert manifest_of(tmp_path).read_bytes() == before
    log.put([2], [2], [rec(2)])  # the holder is unaffected
    close(slot_file, log)
    assert (tmp_path / "kvtier-rank0.slots").exists()


def test_symlinks_are_never_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A symlinked slot file is refused; a symlinked manifest is discarded, its target kept."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    link = tmp_path / "kvtier-rank0.slots"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError, match="disk tier file is a symlink"):
        open_tier_files(tmp_path)
    link.unlink()
    slot_file, log, _ = open_tier_files(tmp_path)
    close(slot_file, log)
    manifest_of(tmp_path).unlink()
    manifest_of(tmp_path).symlink_to(victim)
    with caplog.at_level(logging.WARNING):
        slot_file, log, live = open_tier_files(tmp_path)
    assert live == {}
    assert "cannot open the manifest" in caplog.text
    assert victim.read_bytes() == b"keep me"
    assert not manifest_of(tmp_path).is_symlink()
    close(slot_file, log)


def test_leftover_temporary_file_is_replaced(tmp_path: Path) -> None:
    """A `.tmp` left by a crash during compaction does not block the next open."""
    Path(str(manifest_of(tmp_path)) + ".tmp").write_bytes(b"junk")
    slot_file, log, _ = open_tier_files(tmp_path)
    assert not Path(str(manifest_of(tmp_path)) + ".tmp").exists()
    close(slot_file, log)


def test_removing_a_manifest_removes_a_leftover_tmp_too(tmp_path: Path) -> None:
    """Regression: a non-persistent tier removed a stale manifest but left the `.tmp` of
    a compaction that a crash interrupted."""
    slots = str(tmp_path / "kvtier-rank0.slots")
    manifest = manifest_of(tmp_path)
    manifest.write_bytes(b"stale")
    Path(str(manifest) + ".tmp").write_bytes(b"half")
    remove_manifest(slots)
    assert os.listdir(tmp_path) == []


def test_non_persistent_slot_file_is_unchanged(tmp_path: Path) -> None:
    """Without persistence the file is still fresh, exclusive and removed at close."""
    path = str(tmp_path / "kvtier-rank0.slots")
    slot_file = SlotFile(path, 4, SLOT, DiskIOMode.PAGE_CACHE)
    assert not slot_file.reused
    with pytest.raises(DiskTierBusyError):
        SlotFile(path, 4, SLOT, DiskIOMode.PAGE_CACHE, persistent=True)
    slot_file.close()
    assert os.listdir(tmp_path) == []


def test_a_second_close_returns_only_once_the_log_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: close() let go of the log's descriptor before syncing it, so a second
    close() meanwhile returned at once, its caller believing the log durable while the
    first was still syncing it. Now each returns once the log is synced and closed."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1], [11], [rec(1)])
    release = threading.Event()
    num_synced: list[int] = []
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        assert release.wait(WAIT_S)
        real_fsync(fd)
        num_synced.append(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    seen: dict[str, int] = {}

    def close_log(name: str) -> None:
        log.close()
        seen[name] = len(num_synced)

    first = start_until_parked(lambda: close_log("first"), "first")  # waits in fsync
    second = start_until_parked(lambda: close_log("second"), "second")  # waits for it
    assert seen == {}
    release.set()
    join_all(first, second)
    monkeypatch.undo()
    assert seen == {"first": 1, "second": 1}
    assert not log.is_open
    slot_file.close()


def test_record_for_a_slot_past_the_end_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A well-formed record (valid checksum) naming slot `num_slots`, one past the last,
    is skipped with a warning naming the slot like a corrupt record; the records before
    and after it count (SPEC §7: recovery never trusts a record this geometry cannot
    hold)."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1, 7], [1, 7], [rec(1), rec(7)])
    close(slot_file, log)
    path = manifest_of(tmp_path)
    with open(path, "ab") as raw:
        raw.write(encode_put(IDENTITY.num_slots, ManifestEntry(9, rec(2))))
        raw.write(encode_put(3, ManifestEntry(3, rec(3))))
    with caplog.at_level(logging.WARNING):
        slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (1, rec(1)), 7: (7, rec(7)), 3: (3, rec(3))}
    assert "(slot 8 outside [0, 8))" in caplog.text
    close(slot_file, log)


def test_a_record_of_the_largest_key_and_token_count_round_trips(tmp_path: Path) -> None:
    """A key of 65535 bytes and 2**32 - 1 tokens fit the record layout (u16, u32): such a
    record is accepted, and a reopen recovers it exactly (SPEC §7)."""
    biggest = SlotRecord(b"k" * 0xFFFF, 0xFFFFFFFF)
    check_record(biggest)
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([4], [44], [biggest])
    close(slot_file, log)
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {4: (44, biggest)}
    close(slot_file, log)


def test_a_record_may_count_its_tokens_with_a_numpy_int() -> None:
    record = SlotRecord(b"k" * 36, np.int64(16))  # type: ignore[arg-type]
    check_record(record)
    plain = SlotRecord(b"k" * 36, 16)
    assert encode_put(3, ManifestEntry(7, record)) == encode_put(3, ManifestEntry(7, plain))
