"""Replay of a manifest damaged in the middle: an invalid record costs only itself.

Replay skips a record that fails its checksum (or names an unknown kind, a slot past the
end, or a length past the end of the file) and resumes at the next valid record; only a
torn record at the very end is simply ignored. Each test writes the header and records
itself (the documented byte format, through the encoders) and damages the bytes.
"""

from __future__ import annotations

import logging
import os
import random
import struct
import tracemalloc
from pathlib import Path

import pytest
import xxhash

from kvtier.offload.plan import SlotRecord
from kvtier.storage import manifest_scan
from kvtier.storage.manifest import ManifestEntry, ManifestIdentity, read_manifest
from kvtier.storage.manifest_format import encode_put, encode_tombstone

NUM_SLOTS = 64
IDENTITY = ManifestIdentity("model-a|kv|sha256:0", NUM_SLOTS, 4096, "kv[0]:4096")
HEADER_BYTES = len(IDENTITY.encode())
NUM_RECORDS = 40  # one put per slot 0..39

pytestmark = pytest.mark.timeout(60)


def entry(slot: int) -> ManifestEntry:
    return ManifestEntry(1000 + slot, SlotRecord(bytes([slot]) * 36, 16))


def puts() -> list[bytes]:
    return [encode_put(slot, entry(slot)) for slot in range(NUM_RECORDS)]


def expected_without(*slots: int) -> dict[int, ManifestEntry]:
    return {slot: entry(slot) for slot in range(NUM_RECORDS) if slot not in slots}


def start_of(records: list[bytes], index: int) -> int:
    """Return the file offset of `records[index]`."""
    return HEADER_BYTES + sum(len(record) for record in records[:index])


def write(path: Path, body: bytes) -> Path:
    path.write_bytes(IDENTITY.encode() + body)
    return path


def replay(path: Path, caplog: pytest.LogCaptureFixture) -> dict[int, ManifestEntry]:
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.manifest"):
        return read_manifest(str(path), IDENTITY)


def raw_record(kind: int, slot: int, key: bytes) -> bytes:
    """Return a record with a valid checksum and any kind or slot (the format by hand)."""
    body = struct.pack("<BIIQH", kind, slot, 16, 7, len(key)) + key
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


@pytest.mark.parametrize(
    ("field_at", "reason"),
    [
        (0, "checksum mismatch"),  # kind
        (2, "checksum mismatch"),  # slot
        (7, "checksum mismatch"),  # num_tokens
        (12, "checksum mismatch"),  # data_sum
        (17, "checksum mismatch"),  # key_len, low byte: the checksum lands in the key
        (18, "key_len 23076 runs past the end of the file"),  # key_len, high byte
        (30, "checksum mismatch"),  # key
        (62, "checksum mismatch"),  # checksum, last byte
    ],
)
def test_a_damaged_byte_in_the_middle_costs_only_its_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field_at: int, reason: str
) -> None:
    records = puts()
    body = bytearray(b"".join(records))
    at = start_of(records, 20)
    body[at - HEADER_BYTES + field_at] ^= 0x5A
    path = write(tmp_path / "m", bytes(body))
    assert replay(path, caplog) == expected_without(20)
    size, length = path.stat().st_size, len(records[20])
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        f"corrupt record at byte {at} of {size}; skipped {length} bytes to the next valid "
        f"record, at byte {at + length} ({reason})"
    ]
    assert caplog.records[0].name == "kvtier.storage.manifest"


def test_several_corrupt_records_cost_only_themselves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Records 3, 10 and 11 (one region: two records in a row) and 30 damaged: three
    warnings, every other record replayed."""
    records = puts()
    body = bytearray(b"".join(records))
    for index in (3, 10, 11, 30):
        body[start_of(records, index) - HEADER_BYTES + 25] ^= 0x01
    path = write(tmp_path / "m", bytes(body))
    assert replay(path, caplog) == expected_without(3, 10, 11, 30)
    skipped = [
        r.getMessage().split("; ")[1].removesuffix(" (checksum mismatch)") for r in caplog.records
    ]
    length = len(records[0])
    assert skipped == [
        f"skipped {length} bytes to the next valid record, at byte {start_of(records, 4)}",
        f"skipped {2 * length} bytes to the next valid record, at byte {start_of(records, 12)}",
        f"skipped {length} bytes to the next valid record, at byte {start_of(records, 31)}",
    ]


@pytest.mark.parametrize("kind", ["random", "zeros", "ones", "kind bytes"])
# 1 + _FIRST_SCAN and 1 + 3 * _FIRST_SCAN: the record after the garbage is the first offset
# of the resync's second and third scan spans (the resync starts one byte past the bad one).
@pytest.mark.parametrize(
    "length",
    [1, 5, 27, 1000, 1 + manifest_scan._FIRST_SCAN, 1 + 3 * manifest_scan._FIRST_SCAN, 3 << 20],
)
def test_garbage_inserted_in_the_middle_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, length: int
) -> None:
    """Garbage between two records, up to 3 MiB (across several read buffers): all records
    replay, one warning naming the garbage's size."""
    filler = {"zeros": b"\x00", "ones": b"\x01", "kind bytes": b"\x01\x02\x03"}
    if kind == "random":
        junk = random.Random(length).randbytes(length)
    else:
        junk = (filler[kind] * length)[:length]
    records = puts()
    body = b"".join(records[:25]) + junk + b"".join(records[25:])
    path = write(tmp_path / "m", body)
    assert replay(path, caplog) == expected_without()
    at = start_of(records, 25)
    assert len(caplog.records) == 1
    assert f"at byte {at} of {path.stat().st_size}; skipped {length} bytes" in caplog.text


@pytest.mark.parametrize("cut", [1, 8, 19, 62])
def test_a_torn_last_record_is_ignored_as_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: int
) -> None:
    records = puts()
    path = write(tmp_path / "m", b"".join(records)[:-cut])
    assert replay(path, caplog) == expected_without(NUM_RECORDS - 1)
    at, size = start_of(records, NUM_RECORDS - 1), path.stat().st_size
    assert len(caplog.records) == 1
    assert f"torn record at the end at byte {at} of {size}; ignoring it (" in caplog.text


@pytest.mark.parametrize("tail", ["damaged last record", "zeros after the records"])
def test_nothing_valid_after_a_corrupt_record_ends_the_replay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, tail: str
) -> None:
    """A damaged last record, or zeros after the last record (a file extended by a crash
    before its bytes landed): the records before replay, one warning."""
    records = puts()
    body = bytearray(b"".join(records))
    lost: tuple[int, ...] = ()
    if tail == "damaged last record":
        body[-10] ^= 0xFF
        lost, at = (NUM_RECORDS - 1,), start_of(records, NUM_RECORDS - 1)
    else:
        at = HEADER_BYTES + len(body)
        body += bytes(4096)
    path = write(tmp_path / "m", bytes(body))
    assert replay(path, caplog) == expected_without(*lost)
    size = path.stat().st_size
    assert len(caplog.records) == 1
    assert (
        f"corrupt record at byte {at} of {size}; no valid record after it, ignoring the "
        f"last {size - at} bytes (checksum mismatch)"
    ) in caplog.text


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (raw_record(9, 5, b"k"), "unknown kind 9"),
        (raw_record(1, NUM_SLOTS, b"k"), f"slot {NUM_SLOTS} outside [0, {NUM_SLOTS})"),
        (raw_record(3, 5, b"k" * 15), "tagged put too short for its tag: key field of 15 B"),
    ],
)
def test_a_well_formed_record_that_cannot_apply_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: bytes, reason: str
) -> None:
    """A record whose checksum matches but whose kind, slot or tag is invalid: skipped
    by its length with a warning naming the bad value, the records after it replay."""
    records = puts()
    path = write(tmp_path / "m", b"".join(records[:20]) + bad + b"".join(records[20:]))
    assert replay(path, caplog) == expected_without()
    assert len(caplog.records) == 1
    after = start_of(records, 20) + len(bad)
    assert f"skipped its {len(bad)} bytes, to the record after it, at byte {after}" in caplog.text
    assert f"({reason})" in caplog.text


def test_many_corrupt_regions_warn_a_few_times_then_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = puts()
    body = bytearray(b"".join(records))
    damaged = range(1, NUM_RECORDS - 1, 4)  # 10 regions, one record each
    for index in damaged:
        body[start_of(records, index) - HEADER_BYTES] ^= 0x01
    path = write(tmp_path / "m", bytes(body))
    assert replay(path, caplog) == expected_without(*damaged)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 6
    assert all("corrupt record at byte" in m for m in messages[:5])
    assert messages[5].endswith(
        f"5 more regions skipped (5 regions of damaged bytes; {5 * len(records[0])} bytes in "
        "all), 10 in this "
        "replay; only the first 5 are named"
    )


def test_a_record_inside_a_valid_key_is_never_a_resync_target(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A put whose key holds the bytes of a valid tombstone of slot 7: a clean replay
    steps over the key, and so does a resync after a corrupt record just before the put
    (the scan finds the put's own start first)."""
    holder = encode_put(8, ManifestEntry(8, SlotRecord(encode_tombstone(7) + b"pad", 16)))
    records = [encode_put(7, entry(7)), encode_put(5, entry(5)), holder]
    clean = write(tmp_path / "clean", b"".join(records))
    live = replay(clean, caplog)
    assert sorted(live) == [5, 7, 8]
    assert caplog.records == []
    body = bytearray(b"".join(records))
    body[len(records[0]) + 30] ^= 0x01  # inside the put of slot 5
    damaged = write(tmp_path / "damaged", bytes(body))
    assert sorted(replay(damaged, caplog)) == [7, 8]
    assert f"skipped {len(records[1])} bytes to the next valid record" in caplog.text


def test_a_record_inside_a_corrupt_records_key_may_replay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The scan cannot tell a record embedded in a damaged record's key from a real one:
    it replays it (its slot, like any skipped or stale record, is at worst a miss: the
    slot's bytes are checked against the data checksum of its entry at every load)."""
    holder = encode_put(8, ManifestEntry(8, SlotRecord(encode_tombstone(7) + b"pad", 16)))
    body = bytearray(encode_put(7, entry(7)) + holder + encode_put(9, entry(9)))
    body[len(encode_put(7, entry(7)))] ^= 0x01  # the kind of the holder
    path = write(tmp_path / "m", bytes(body))
    assert sorted(replay(path, caplog)) == [9]  # the embedded tombstone dropped slot 7
    assert len(caplog.records) == 2  # the holder's head, and the "pad" after the tombstone


def test_a_huge_hole_in_the_middle_is_crossed_in_bounded_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """64 MiB of zeros (sparse here) between two halves of the records: the scan crosses
    them a read buffer at a time, and the records after the hole replay."""
    records = puts()
    path = write(tmp_path / "m", b"".join(records[:20]))
    hole = 64 << 20
    os.truncate(path, path.stat().st_size + hole)
    with open(path, "ab") as out:
        out.write(b"".join(records[20:]))
    tracemalloc.start()
    try:
        live = replay(path, caplog)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    assert live == expected_without()
    assert f"skipped {hole} bytes to the next valid record" in caplog.text


def test_records_across_read_buffers_replay_and_resync(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys of up to 65535 bytes (~6 MiB of records): records straddle the window's
    1 MiB reads. Clean, all replay; with the records that cross a MiB boundary of the
    record area damaged (the scans then refill the window too), all others replay."""
    rng = random.Random(7)
    history = [
        (
            slot % NUM_SLOTS,
            ManifestEntry(slot, SlotRecord(rng.randbytes(rng.randrange(1 << 16)), 1)),
        )
        for slot in range(200)
    ]
    records = [encode_put(slot, e) for slot, e in history]
    expected = dict(history)  # the last put of each slot wins
    path = write(tmp_path / "clean", b"".join(records))
    assert replay(path, caplog) == expected
    assert caplog.records == []
    body = bytearray(b"".join(records))
    starts = [start_of(records, i) - HEADER_BYTES for i in range(len(records))]
    crossing = [i for i in range(len(records) - 1) if starts[i] >> 20 != starts[i + 1] >> 20]
    for index in crossing:
        body[starts[index] + 5] ^= 0x80
    path = write(tmp_path / "damaged", bytes(body))
    kept = [(s, e) for i, (s, e) in enumerate(history) if i not in crossing]
    assert replay(path, caplog) == dict(kept)
    assert len(caplog.records) == min(len(crossing), 5) + (len(crossing) > 5)


@pytest.mark.parametrize("slot", [(1 << 24) - 1, 1 << 24, (1 << 25) - 1])
def test_the_scan_finds_a_record_of_a_slot_with_a_high_top_byte(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, slot: int
) -> None:
    """A tier of 2**25 slots: the scan's first pass keeps slot fields up to the largest
    top byte the tier allows, so a record of its last slot is found after garbage."""
    identity = ManifestIdentity(IDENTITY.fingerprint, 1 << 25, 4096, IDENTITY.region_layout)
    after = encode_put(slot, entry(5))
    path = tmp_path / "m"
    path.write_bytes(identity.encode() + puts()[0] + b"\x01" * 5000 + after)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.manifest"):
        live = read_manifest(str(path), identity)
    assert live == {0: entry(0), slot: entry(5)}
    assert "skipped 5000 bytes" in caplog.text


def test_each_resync_scans_about_as_far_as_the_next_valid_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every other record corrupt: each resync filters the bytes up to the next record,
    not the rest of the 1 MiB read window (which made such a file's replay quadratic in
    the records per window: 200k records, half corrupt, took over a minute)."""
    rng = random.Random(7)
    records = []
    for n in range(4000):
        record = bytearray(
            encode_put(n % NUM_SLOTS, ManifestEntry(n, SlotRecord(rng.randbytes(36), 16)))
        )
        if n % 2:
            record[-1] ^= 0xFF
        records.append(bytes(record))
    body = b"".join(records)
    scanned = []
    real = manifest_scan._candidates

    def counting(data: bytes, lo: int, hi: int, num_slots: int, room: int) -> list[tuple[int, int]]:
        scanned.append(hi - lo)
        return real(data, lo, hi, num_slots, room)

    monkeypatch.setattr(manifest_scan, "_candidates", counting)
    live = replay(write(tmp_path / "m", body), caplog)
    assert sorted(live) == list(range(0, NUM_SLOTS, 2))  # the odd records are corrupt
    assert len(scanned) >= 2000
    assert sum(scanned) <= 64 * len(body), f"filtered {sum(scanned)} B of a {len(body)} B file"
