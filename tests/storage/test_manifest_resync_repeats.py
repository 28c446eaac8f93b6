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
import tracemalloc
from pathlib import Path
from typing import Any

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


def fingerprinting_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record, for each call of `_first_of_repeats` that computes fingerprints (enough
    candidates lie whole in the window), how many candidates it was given."""
    calls: list[int] = []
    real = manifest_scan._first_of_repeats

    def spied(raw: Any, at: Any, ends: Any) -> Any:
        if int((ends <= len(raw)).sum()) >= manifest_scan._DEDUPE_FROM:
            calls.append(len(at))
        return real(raw, at, ends)

    monkeypatch.setattr(manifest_scan, "_first_of_repeats", spied)
    return calls


def test_a_resync_to_the_next_record_computes_no_fingerprints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged put followed by valid records, 200 times: each resync stops at the first
    candidate, so no fingerprint is computed (helper's code fingerprinted every pass of
    64 candidates or more, here the ~150 tombstones of each 4 KiB span and the random
    lengths of candidates inside their bytes, up to 64 KiB: 200 calls, and a replay of
    such a file 3.5 times as slow as without them)."""
    calls = fingerprinting_calls(monkeypatch)
    parts = []
    for n in range(200):
        damaged = bytearray(encode_put(n % NUM_SLOTS, entry(n % NUM_SLOTS)))
        damaged[-1] ^= 0x01
        parts += [bytes(damaged), *(encode_tombstone(s) for s in range(NUM_SLOTS))]
    parts.append(encode_put(3, entry(3)))
    assert replay(tmp_path / "m", b"".join(parts), caplog) == {3: entry(3)}
    assert calls == []


def test_a_damaged_region_is_deduplicated_a_batch_at_a_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 MiB of candidates (one every 8 bytes, all distinct) before a valid record: the
    fingerprints are computed over one batch of candidates at a time, so the arrays
    stay small (helper's code: one call over the whole window's 2**17 candidates, ~28
    MiB of arrays at once for a 1 MiB window)."""
    calls = fingerprinting_calls(monkeypatch)
    rng = random.Random(5)
    region = b"".join(
        bytes([1, rng.randrange(NUM_SLOTS), 0, 0, 0, *rng.randbytes(3)]) for _ in range(1 << 17)
    )
    body = encode_put(1, entry(1)) + region + encode_put(2, entry(2))
    tracemalloc.start()
    try:
        assert replay(tmp_path / "m", body, caplog) == {1: entry(1), 2: entry(2)}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, f"peak {peak} B"  # ~6.2 MiB: the file's window and candidates
    assert calls
    assert max(calls) <= 1024  # `_DEDUPE_BATCH`
