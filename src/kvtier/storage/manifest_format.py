"""The byte format of a manifest (see `manifest`): the header and record layouts, their
encoding, and the identity a header must match.

Integers are little-endian, checksums are xxh3-64.

    header   magic      8 B   b"KVTMANI1"
             version    u32   1
             num_slots  u64   slots of the slot file        } the worker's geometry
             slot_bytes u64   bytes per slot                }
             layout_len u32   bytes of layout
             fp_len     u32   bytes of fp
             layout     utf-8 "name:bytes;..." per region, in slot order
             fp         utf-8 the fingerprint: the engine's (model, KV layout, hashing)
             checksum   u64   xxh3-64 of every header byte before it

    record   kind       u8    1 = put, 2 = tombstone (the slot holds nothing),
                              3 = tagged put (the token check on)
             slot       u32   slot id, < num_slots
             num_tokens u32   tokens of the block (0 in a tombstone)
             data_sum   u64   xxh3-64 of the slot's bytes (0 in a tombstone)
             key_len    u16,  key  key_len bytes (empty in a tombstone; in a tagged put,
                              the key followed by its 16-byte token tag)
             checksum   u64   xxh3-64 of every record byte before it

A reader that predates kind 3 stops its replay at the first tagged put (a corrupt
record to it): the slots recorded after it are only misses. This reader skips a record
it cannot use, one of an unknown kind included, and resumes at the next (`manifest_read`).

Decoding is in `manifest_scan`, replay in `manifest_read`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvtier.core.token_tags import TAG_SIZE
from kvtier.offload.plan import SlotRecord

__all__ = [
    "CHECKSUM",
    "HEADER",
    "MAGIC",
    "MANIFEST_VERSION",
    "MAX_RECORD_SLOTS",
    "PUT",
    "TAGGED_PUT",
    "RECORD",
    "TOMBSTONE",
    "ManifestEntry",
    "ManifestError",
    "ManifestIdentity",
    "check_record",
    "encode_put",
    "encode_tombstone",
]

MAGIC = b"KVTMANI1"
MANIFEST_VERSION = 1
HEADER = struct.Struct("<8sIQQII")  # magic, version, num_slots, slot_bytes, lengths
RECORD = struct.Struct("<BIIQH")  # kind, slot, num_tokens, data_sum, key_len
CHECKSUM = struct.Struct("<Q")
PUT, TOMBSTONE, TAGGED_PUT = 1, 2, 3
_MAX_KEY = (1 << 16) - 1
_MAX_TOKENS = (1 << 32) - 1
MAX_RECORD_SLOTS = 1 << 32  # a record's slot field is a u32


class ManifestError(ValueError):
    """A manifest that cannot be used for this tier; the message says why."""


@dataclass(frozen=True)
class ManifestIdentity:
    """What a manifest must match to be reused: the engine's fingerprint and the worker's
    slot geometry (the I/O mode does not matter)."""

    fingerprint: str
    num_slots: int
    bytes_per_slot: int
    region_layout: str = ""  # "name:bytes;..." of the regions, in slot order

    def encode(self) -> bytes:
        """Return the header bytes, checksum included."""
        layout, fingerprint = self.region_layout.encode(), self.fingerprint.encode()
        body = HEADER.pack(
            MAGIC,
            MANIFEST_VERSION,
            self.num_slots,
            self.bytes_per_slot,
            len(layout),
            len(fingerprint),
        )
        body += layout + fingerprint
        return body + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


@dataclass(frozen=True)
class ManifestEntry:
    """A live slot: the checksum of its bytes and what they are."""

    checksum: int
    record: SlotRecord


def check_record(record: SlotRecord) -> None:
    """Raise ValueError unless `record` fits the record layout."""
    max_key = _MAX_KEY if record.tag is None else _MAX_KEY - TAG_SIZE
    if not isinstance(record.key, bytes) or len(record.key) > max_key:
        raise ValueError(f"slot record key must be bytes of at most {max_key} B: {record!r}")
    if record.tag is not None and (
        not isinstance(record.tag, bytes) or len(record.tag) != TAG_SIZE
    ):
        raise ValueError(f"slot record tag must be {TAG_SIZE} bytes: {record!r}")
    count = record.num_tokens
    if isinstance(count, bool) or not hasattr(count, "__index__") or not 0 <= count <= _MAX_TOKENS:
        raise ValueError(
            f"slot record num_tokens must be an int in [0, {_MAX_TOKENS}], got {count!r}"
        )


def _encode_record(kind: int, slot: int, checksum: int, key: bytes, num_tokens: int) -> bytes:
    body = RECORD.pack(kind, slot, num_tokens, checksum, len(key)) + key
    return body + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def encode_put(slot: int, entry: ManifestEntry) -> bytes:
    """Return the put record of `slot` holding `entry`, checksum included."""
    record = entry.record
    if record.tag is not None:
        blob = record.key + record.tag
        return _encode_record(TAGGED_PUT, slot, entry.checksum, blob, record.num_tokens)
    return _encode_record(PUT, slot, entry.checksum, record.key, record.num_tokens)


def decode_put(kind: int, blob: bytes, num_tokens: int) -> SlotRecord | None:
    """Return the record of a put of `kind` whose key field is `blob`; None if malformed."""
    if kind == PUT:
        return SlotRecord(blob, num_tokens)
    if len(blob) < TAG_SIZE:
        return None
    return SlotRecord(blob[:-TAG_SIZE], num_tokens, blob[-TAG_SIZE:])


def encode_tombstone(slot: int) -> bytes:
    """Return the tombstone record of `slot` (it holds nothing), checksum included."""
    return _encode_record(TOMBSTONE, slot, 0, b"", 0)
