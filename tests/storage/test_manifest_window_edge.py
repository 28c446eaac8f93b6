"""Records that straddle the end of the replay's read window (`READ_BUFFER`) are decoded
one by one (`RecordReader.record_at`), outside the replay's hot loop: a tombstone there
still drops its slot, and a put of a slot past a shrunk tier's end is still left out."""

from __future__ import annotations

from pathlib import Path

from kvtier.offload.plan import SlotRecord
from kvtier.storage import ManifestIdentity
from kvtier.storage.manifest import read_manifest, read_manifest_any_size
from kvtier.storage.manifest_format import CHECKSUM, RECORD
from kvtier.storage.manifest_log import ManifestLog
from kvtier.storage.manifest_scan import READ_BUFFER

IDENTITY = ManifestIdentity("model-a|kv|sha256:0", 8, 4096, "kv[0]:4096")
SHRUNK = ManifestIdentity("model-a|kv|sha256:0", 5, 4096, "kv[0]:4096")
MAX_KEY = 60_000  # below the u16 key_len


def fill_to(log: ManifestLog, size: int, end: int) -> None:
    """Append puts of slot 0 until the file is `end` bytes long (from `size`)."""
    overhead = RECORD.size + CHECKSUM.size
    while size < end:
        left = end - size
        key_len = min(MAX_KEY, left - overhead)
        if left - (overhead + key_len) < overhead + 1 and left > overhead + key_len:
            key_len = (left - overhead) // 2  # leave room for one more put
        log.put([0], [7], [SlotRecord(b"k" * key_len, 4)])
        size += overhead + key_len
    assert size == end


def straddling_manifest(tmp_path: Path, last: str) -> str:
    """Write a manifest whose `last` record ("tombstone" of slot 1, or "put" of slot 5)
    starts 3 bytes before the end of the replay's first window."""
    path = str(tmp_path / "m.manifest")
    header = IDENTITY.encode()
    log = ManifestLog(path, header, {}, compact_floor=1 << 30)
    log.put([1, 5], [1, 5], [SlotRecord(b"one", 4), SlotRecord(b"five", 4)])
    if last == "put":
        log.forget([5])
    size = len(header) + 2 * (RECORD.size + CHECKSUM.size) + len(b"one") + len(b"five")
    size += RECORD.size + CHECKSUM.size if last == "put" else 0
    fill_to(log, size, len(header) + READ_BUFFER - 3)
    if last == "tombstone":
        log.forget([1])
    else:
        log.put([5], [5], [SlotRecord(b"five again", 4)])
    log.close()
    assert Path(path).stat().st_size > len(header) + READ_BUFFER
    return path


def test_a_tombstone_across_the_window_end_drops_its_slot(tmp_path: Path) -> None:
    live = read_manifest(straddling_manifest(tmp_path, "tombstone"), IDENTITY)
    assert sorted(live) == [0, 5]


def test_a_put_across_the_window_end_past_a_shrunk_tier_is_left_out(tmp_path: Path) -> None:
    path = straddling_manifest(tmp_path, "put")
    assert sorted(read_manifest(path, IDENTITY)) == [0, 1, 5]  # the straddling put applies
    live, num_slots = read_manifest_any_size(path, SHRUNK)
    assert num_slots == 8
    assert sorted(live) == [0, 1]
