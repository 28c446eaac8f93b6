"""A damaged region of a repeating pattern is scanned one distinct candidate a period.

Regression: a key of crafted bytes (a candidate record head every 8 bytes) behind a
damaged record made the resync check every candidate in Python, about 8000 checks per
64 KiB (~0.1-0.4 s per MiB). The scan now leaves out a candidate whose record bytes
repeat one just before it (`manifest_scan._first_of_repeats`): the same verdict, so the
same records replay. Counted in record checksums computed, not in time.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import xxhash

from kvtier.offload.plan import SlotRecord
from kvtier.storage import manifest_scan
from kvtier.storage.manifest import ManifestEntry, ManifestIdentity, read_manifest
from kvtier.storage.manifest_format import encode_put, encode_tombstone

NUM_SLOTS = 64
IDENTITY = ManifestIdentity("model-a|kv|sha256:0", NUM_SLOTS, 4096, "kv[0]:4096")
# A record head every 8 bytes: kind 1 (put), slot 0, key_len 0; each fails its checksum.
CRAFTED = bytes([1, 0, 0, 0, 0, 0, 0, 0])

pytestmark = pytest.mark.timeout(120)


def entry(slot: int, key: bytes | None = None) -> ManifestEntry:
    return ManifestEntry(1000 + slot, SlotRecord(key or bytes([slot]) * 36, 16))


def replay(path: Path, body: bytes, caplog: pytest.LogCaptureFixture) -> dict[int, object]:
    path.write_bytes(IDENTITY.encode() + body)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.manifest"):
        return dict(read_manifest(str(path), IDENTITY))


def count_checksums(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the checksums the replay computes (each candidate checked costs one)."""
    calls: list[int] = []
    real_digest = xxhash.xxh3_64_intdigest

    def counted(data: bytes) -> int:
        calls.append(len(data))
        return real_digest(data)

    monkeypatch.setattr(manifest_scan.xxhash, "xxh3_64_intdigest", counted)
    monkeypatch.setattr(manifest_scan, "_DIGEST", counted)
    return calls


@pytest.mark.parametrize("where", ["garbage", "damaged key"])
def test_a_damaged_repeating_region_costs_a_few_checks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """256 KiB of the pattern between valid records, or 32 puts whose keys hold 8 KiB of
    it and whose checksums are damaged: the records around it replay, and the scan
    checks a few candidates per pass instead of one per 8 bytes (old code: ~32800)."""
    calls = count_checksums(monkeypatch)
    before = [encode_put(slot, entry(slot)) for slot in range(5)]
    after = [encode_put(slot, entry(slot)) for slot in range(5, 10)]
    if where == "garbage":
        region = CRAFTED * (1 << 15)
    else:
        damaged = []
        for slot in range(10, 42):
            record = bytearray(encode_put(slot, entry(slot, CRAFTED * 1024)))
            record[-1] ^= 0x01
            damaged.append(bytes(record))
        region = b"".join(damaged)
    body = b"".join(before) + region + b"".join(after)
    assert replay(tmp_path / "m", body, caplog) == {slot: entry(slot) for slot in range(10)}
    assert f"skipped {len(region)} bytes to the next valid record" in caplog.text
    assert len(calls) < 400  # new code: 206 with the 32 damaged keys


def periodic_garbage(rng: random.Random) -> bytes:
    """Return a repeating pattern dense in candidate records, sometimes broken by a valid
    record, a tombstone or a stray byte (which the scan must still find or step over)."""
    period = rng.randrange(1, 30)
    pattern = bytes(rng.choice([0, 0, 0, 1, 2, 3, rng.randrange(256)]) for _ in range(period))
    if rng.random() < 0.2:  # the pattern is a valid record itself
        pattern = encode_tombstone(rng.randrange(NUM_SLOTS))
    garbage = bytearray(pattern * rng.randrange(1, 4000 // len(pattern) + 2))
    for _ in range(rng.randrange(3)):
        at = rng.randrange(len(garbage) + 1)
        inserted = rng.choice(
            [
                encode_put(rng.randrange(NUM_SLOTS), entry(rng.randrange(NUM_SLOTS))),
                encode_tombstone(rng.randrange(NUM_SLOTS)),
                bytes([rng.randrange(256)]),
            ]
        )
        garbage[at:at] = inserted
    return bytes(garbage)


@pytest.mark.parametrize("seed", range(60))
def test_leaving_repeats_out_changes_no_replay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Random files of valid records and repeating damaged regions replay to the same
    slots, with the same warnings, as a scan that checks every candidate."""
    rng = random.Random(seed)
    parts = []
    for _ in range(rng.randrange(1, 6)):
        parts += [encode_put(s, entry(s)) for s in rng.sample(range(NUM_SLOTS), 3)]
        parts.append(periodic_garbage(rng))
    body = b"".join(parts)
    deduped = replay(tmp_path / "m", body, caplog)
    warnings = [r.getMessage() for r in caplog.records]
    monkeypatch.setattr(manifest_scan, "_DEDUPE_FROM", 1 << 40)
    assert replay(tmp_path / "m", body, caplog) == deduped
    assert [r.getMessage() for r in caplog.records] == warnings
