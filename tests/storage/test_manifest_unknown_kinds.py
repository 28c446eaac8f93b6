"""A well-formed manifest record that cannot be applied (its checksum matches; a later
format's kind, say) is skipped by its length, not scanned byte by byte.

Regressions: replay treated such a record as damaged bytes and scanned from its second
byte for the next valid record, so (a) a record inside its key bytes was applied as if
it were one, and (b) a key of crafted bytes (a candidate record head every 8 bytes)
made the scan check each candidate in Python: ~0.3 s per MiB of such records.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import xxhash

from kvtier.offload.plan import SlotRecord
from kvtier.storage.manifest import ManifestEntry, ManifestIdentity, read_manifest
from kvtier.storage.manifest_format import encode_put
from kvtier.storage.manifest_scan import RecordReader

NUM_SLOTS = 64
IDENTITY = ManifestIdentity("model-a|kv|sha256:0", NUM_SLOTS, 4096, "kv[0]:4096")
FUTURE_KIND = 4
# A record head every 8 bytes: kind 1 (put), slot 0, key_len 0; each fails its checksum.
CRAFTED_KEY = bytes([1, 0, 0, 0, 0, 0, 0, 0]) * 8000

pytestmark = pytest.mark.timeout(60)


def entry(slot: int) -> ManifestEntry:
    return ManifestEntry(1000 + slot, SlotRecord(bytes([slot]) * 36, 16))


def raw_record(kind: int, slot: int, key: bytes) -> bytes:
    """Return a record with a valid checksum and any kind (the format by hand)."""
    body = struct.pack("<BIIQH", kind, slot, 16, 7, len(key)) + key
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def replay(path: Path, body: bytes, caplog: pytest.LogCaptureFixture) -> dict[int, object]:
    path.write_bytes(IDENTITY.encode() + body)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.manifest"):
        return dict(read_manifest(str(path), IDENTITY))


def test_a_record_inside_a_later_kinds_key_is_not_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The key of a kind-4 record holds a put of slot 50: bytes of the kind-4 record,
    not a record of this file (old code: slot 50 came back live)."""
    inner = encode_put(50, entry(50))
    body = encode_put(1, entry(1)) + raw_record(FUTURE_KIND, 2, inner) + encode_put(3, entry(3))
    assert replay(tmp_path / "m", body, caplog) == {1: entry(1), 3: entry(3)}
    assert len(caplog.records) == 1
    assert "record that cannot be applied" in caplog.text
    assert f"(unknown kind {FUTURE_KIND})" in caplog.text


@pytest.mark.parametrize("last", [False, True])
def test_later_kinds_with_crafted_keys_cost_one_check_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, last: bool
) -> None:
    """Counted in records decoded one by one (`record_at`), not in time: one per kind-4
    record (old code: one per candidate in its key, 8000 per record)."""
    calls = []
    real_record_at = RecordReader.record_at

    def counted(self: RecordReader, pos: int) -> object:
        calls.append(pos)
        return real_record_at(self, pos)

    monkeypatch.setattr(RecordReader, "record_at", counted)
    future = [raw_record(FUTURE_KIND, slot, CRAFTED_KEY) for slot in range(10, 30)]
    puts = [encode_put(slot, entry(slot)) for slot in range(5)]
    body = b"".join(puts) + b"".join(future) + (b"" if last else encode_put(7, entry(7)))
    expected = {slot: entry(slot) for slot in range(5)} | ({} if last else {7: entry(7)})
    assert replay(tmp_path / "m", body, caplog) == expected
    assert len(calls) <= len(future) + 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 6  # five named, then one line counting the rest
    assert messages[-1].endswith(
        f"15 more regions skipped (15 well-formed records that cannot be applied; "
        f"{15 * len(future[0])} bytes in all), 20 in this replay; only the first 5 are named"
    )


def test_the_summary_counts_each_kind_of_skipped_region(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the first five, the summary names what the skipped regions were: damaged
    bytes, well-formed records that cannot be applied, a torn last record (old code
    called them all corrupt regions)."""
    puts = [encode_put(slot, entry(slot)) for slot in range(12)]
    damaged = bytearray(encode_put(40, entry(40)))
    damaged[-1] ^= 0x01  # its checksum fails
    future = raw_record(FUTURE_KIND, 41, b"k")
    # Five named (damaged), then two damaged, three of kind 4 and a torn record.
    parts = [puts[0]]
    for index, bad in enumerate([bytes(damaged)] * 7 + [future] * 3):
        parts += [bad, puts[index + 1]]
    torn = encode_put(42, entry(42))[:-3]
    assert replay(tmp_path / "m", b"".join(parts) + torn, caplog) == {
        slot: entry(slot) for slot in range(11)
    }
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 6
    unnamed = 2 * len(damaged) + 3 * len(future) + len(torn)
    assert messages[-1].endswith(
        "6 more regions skipped (2 regions of damaged bytes, 3 well-formed records that "
        f"cannot be applied, 1 torn record at the end; {unnamed} bytes in all), 11 in this "
        "replay; only the first 5 are named"
    )


def test_one_unnamed_region_is_counted_in_the_singular(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Six skipped regions: the summary counts one more region, in the singular (helper's
    code: "1 more regions skipped (1 torn record at the end; ...)")."""
    puts = [encode_put(slot, entry(slot)) for slot in range(6)]
    future = raw_record(FUTURE_KIND, 41, b"k")
    torn = encode_put(42, entry(42))[:-3]
    body = b"".join(p + future for p in puts[:5]) + puts[5] + torn
    assert replay(tmp_path / "m", body, caplog) == {slot: entry(slot) for slot in range(6)}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 6
    assert messages[-1].endswith(
        f"1 more region skipped (1 torn record at the end; {len(torn)} bytes in all), 6 in "
        "this replay; only the first 5 are named"
    )
