"""A skipped manifest record never makes the disk tier serve wrong bytes.

Replay skips a corrupt record in the middle of the manifest and goes on. Skipping a
tombstone brings back the slot's earlier put, skipping a put the slot's earlier put (the
older key): in both cases the slot's bytes may have been overwritten since. These tests
go through a real `DiskTier`: the resurrected slot is offered again (`recovered_slots`),
and reading it either fails its data checksum (a miss) or returns exactly the bytes that
were stored under the resurrected key; the slot is then tombstoned for the next run.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOError, DiskIOMode, DiskTier, DiskTierConfig
from kvtier.storage.manifest_format import PUT, TOMBSTONE

SLOT = 4096
OLD, NEW, OTHER = SlotRecord(b"old-key", 16), SlotRecord(b"new-key", 16), SlotRecord(b"k6", 16)

pytestmark = pytest.mark.timeout(60)


def open_tier(tmp_path: Path) -> DiskTier:
    return DiskTier(
        DiskTierConfig(
            str(tmp_path / "kvtier-rank0.slots"),
            num_slots=8,
            bytes_per_slot=SLOT,
            io_mode=DiskIOMode.PAGE_CACHE,
            batch_bytes=SLOT,
            fingerprint="fp",
        )
    )


def write(tier: DiskTier, slot: int, fill: int, record: SlotRecord | None) -> bytes:
    """Write `fill` repeated to `slot` (with `record`, or none); return the bytes."""
    buffer = tier.store_buffers[0]
    buffer.tensor[0] = fill
    tier.write_slots(buffer, np.array([slot]), None if record is None else [record]).result()
    return bytes([fill]) * SLOT


def read(tier: DiskTier, slot: int) -> bytes | None:
    """Return the bytes a load of `slot` serves, or None when it fails (a miss)."""
    buffer = tier.load_buffers[0]
    try:
        tier.read_slots(buffer, np.array([slot])).result()
    except DiskIOError as exc:
        if "checksum mismatch" not in str(exc):
            raise
        return None
    return buffer.tensor[0].numpy().tobytes()


def damage_record(path: Path, header_bytes: int, index: int, kind: int) -> None:
    """Flip a byte of the data checksum field of record `index`, of kind `kind` (any kind
    has that field)."""
    data = bytearray(path.read_bytes())
    at = header_bytes
    for _ in range(index):  # the documented layout: kind, slot, tokens, sum, key_len
        key_len = struct.unpack_from("<H", data, at + 17)[0]
        at += 19 + key_len + 8
    assert data[at] == kind
    data[at + 12] ^= 0x01
    path.write_bytes(bytes(data))


def reopen_after_damage(tmp_path: Path, tier: DiskTier, index: int, kind: int) -> DiskTier:
    """Close `tier`, damage its record `index` (of `kind`) and open it again."""
    header_bytes = len(tier.config.identity.encode())  # type: ignore[union-attr]
    tier.close()
    damage_record(tmp_path / "kvtier-rank0.manifest", header_bytes, index, kind)
    return open_tier(tmp_path)


@pytest.mark.parametrize("same_bytes", [False, True])
def test_a_skipped_tombstone_never_serves_the_bytes_written_after_it(
    tmp_path: Path, same_bytes: bool
) -> None:
    """Records: put(3, OLD); tombstone(3), then slot 3 rewritten without a record; put(6).
    The tombstone is damaged: OLD comes back for slot 3, whose bytes are the new ones. A
    load fails its checksum unless the new bytes equal OLD's (then they are OLD's)."""
    tier = open_tier(tmp_path)
    old_bytes = write(tier, 3, 0x11, OLD)
    write(tier, 3, 0x11 if same_bytes else 0x22, None)  # tombstones slot 3 first
    other = write(tier, 6, 0x66, OTHER)
    tier = reopen_after_damage(tmp_path, tier, 1, TOMBSTONE)
    assert tier.recovered_slots() == [(3, OLD), (6, OTHER)]
    assert read(tier, 3) == (old_bytes if same_bytes else None)
    assert read(tier, 6) == other
    tier.close()
    tier = open_tier(tmp_path)  # the failed load tombstoned slot 3
    assert tier.recovered_slots() == ([(3, OLD)] if same_bytes else []) + [(6, OTHER)]
    tier.close()


@pytest.mark.parametrize("same_bytes", [False, True])
def test_a_skipped_put_never_serves_its_bytes_under_the_older_key(
    tmp_path: Path, same_bytes: bool
) -> None:
    """Records: put(3, OLD); tombstone(3) (a rewrite drops the old record first); put(3,
    NEW) over other bytes; put(6). The tombstone and the second put are damaged (or the
    manifest is an older version's, without the tombstone): OLD comes back for slot 3. A
    load fails its checksum unless NEW's bytes equal OLD's; NEW's bytes are never served
    as OLD's otherwise."""
    tier = open_tier(tmp_path)
    old_bytes = write(tier, 3, 0x11, OLD)
    write(tier, 3, 0x11 if same_bytes else 0x22, NEW)
    other = write(tier, 6, 0x66, OTHER)
    header_bytes = len(tier.config.identity.encode())  # type: ignore[union-attr]
    tier.close()
    damage_record(tmp_path / "kvtier-rank0.manifest", header_bytes, 1, TOMBSTONE)
    damage_record(tmp_path / "kvtier-rank0.manifest", header_bytes, 2, PUT)
    tier = open_tier(tmp_path)
    assert tier.recovered_slots() == [(3, OLD), (6, OTHER)]
    assert read(tier, 3) == (old_bytes if same_bytes else None)
    assert read(tier, 6) == other
    tier.close()
    tier = open_tier(tmp_path)
    assert tier.recovered_slots() == ([(3, OLD)] if same_bytes else []) + [(6, OTHER)]
    tier.close()
