"""Token tags in a persistent disk tier's manifest (SPEC §3 Beyond, §7): kind 3 records."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import xxhash
from test_manifest import close, manifest_of, open_tier_files, rec

from kvtier.offload.plan import SlotRecord
from kvtier.storage.manifest_format import (
    CHECKSUM,
    RECORD,
    TAGGED_PUT,
    ManifestEntry,
    check_record,
    encode_put,
)

pytestmark = pytest.mark.timeout(60)
TAG = bytes(range(16))


def tagged(i: int) -> SlotRecord:
    plain = rec(i)
    return SlotRecord(plain.key, plain.num_tokens, bytes([i]) * 16)


def test_tagged_and_plain_records_round_trip_and_survive_compaction(tmp_path: Path) -> None:
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1, 2, 3], [11, 22, 33], [tagged(1), rec(2), tagged(3)])
    log.put([1], [44], [tagged(4)])  # the last record of a slot wins, tag included
    close(slot_file, log)
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (44, tagged(4)), 2: (22, rec(2)), 3: (33, tagged(3))}
    close(slot_file, log)


def test_a_tagged_put_is_kind_3_with_the_tag_after_the_key() -> None:
    record = encode_put(5, ManifestEntry(7, SlotRecord(b"key", 16, TAG)))
    assert record[0] == TAGGED_PUT
    assert record[19:-8] == b"key" + TAG


def test_a_tagged_put_too_short_for_its_tag_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tagged put (valid checksum) whose key field cannot hold a tag: skipped with a
    warning, the record after it replays."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1], [11], [tagged(1)])
    close(slot_file, log)
    body = RECORD.pack(TAGGED_PUT, 2, 16, 2, 3) + b"abc"  # a 3-byte key field: no tag
    raw = body + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))
    with open(manifest_of(tmp_path), "ab") as out:
        out.write(raw + encode_put(3, ManifestEntry(33, tagged(3))))
    with caplog.at_level(logging.WARNING):
        slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (11, tagged(1)), 3: (33, tagged(3))}
    assert "too short for its tag" in caplog.text
    close(slot_file, log)


def test_a_tagged_put_of_an_empty_key_replays_after_damaged_bytes(tmp_path: Path) -> None:
    """A key field holding the tag alone is a whole tagged put, also where the replay
    decodes it one by one (`record_at`: found by the scan past damaged bytes)."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1], [11], [tagged(1)])
    close(slot_file, log)
    with open(manifest_of(tmp_path), "ab") as out:
        out.write(b"\xff" * 7 + encode_put(2, ManifestEntry(22, SlotRecord(b"", 4, TAG))))
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (11, tagged(1)), 2: (22, SlotRecord(b"", 4, TAG))}
    close(slot_file, log)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (SlotRecord(b"k", 1, b"short"), "tag must be 16 bytes"),
        (SlotRecord(b"k" * 0xFFFF, 1, TAG), "at most 65519 B"),
        (SlotRecord(b"k", 1 << 32, TAG), "num_tokens must be an int in"),  # a u32 field
    ],
)
def test_check_record_refuses_a_bad_tag_or_a_key_with_no_room_for_it(
    record: SlotRecord, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_record(record)
    check_record(SlotRecord(b"k" * (0xFFFF - 16), 1, TAG))
