"""The manifest of a persistent disk tier: what each slot of the slot file holds.

`kvtier-rank{N}.manifest` lives beside `kvtier-rank{N}.slots`. It is a header followed by
an append-only log of records; integers are little-endian, checksums are xxh3-64.

    header   magic      8 B   b"KVTMANI1"
             version    u32   1
             num_slots  u64   slots of the slot file        } the worker's geometry
             slot_bytes u64   bytes per slot                }
             layout_len u32,  layout   utf-8: "name:bytes;..." per region, in slot order
             fp_len     u32,  fingerprint  utf-8, the engine's (model, KV layout, hashing)
             checksum   u64   xxh3-64 of every header byte before it

    record   kind       u8    1 = put, 2 = tombstone (the slot holds nothing)
             slot       u32   slot id, < num_slots
             num_tokens u32   tokens of the block (0 in a tombstone)
             data_sum   u64   xxh3-64 of the slot's bytes (0 in a tombstone)
             key_len    u16,  key  key_len bytes (empty in a tombstone)
             checksum   u64   xxh3-64 of every record byte before it

Rules. A slot's data is written before its put record is appended, and every append is
one `write` call on an O_APPEND descriptor (no fsync per record). Replay applies records
in order, the last record of a slot wins; the first record that is cut short or fails its
checksum ends the replay with a warning (later records are ignored: an ignored record can
only cause a miss). A record never makes a read return wrong bytes: reads are verified
against `data_sum`, so a stale record whose slot was rewritten since (a crash between the
data write and its record, power loss) fails verification instead. Tombstones keep a
restart from offering a slot that is known to be bad or overwritten.

At open (`open_manifest`) the header must match the identity exactly and the slot file
must have its exact size; otherwise both files are discarded and recreated (with a
warning naming the reason). A reused manifest is compacted at once: the live records are
written to a temporary file in the same directory, fsynced, and renamed over it.

During a run the log compacts itself the same way, under the lock that serializes the
appends, right after an append that leaves it holding more than 4 records per live slot
and more than 4096 records (`manifest_compaction.compaction_due`); later records go to
the new file. The file at the manifest path is always a complete log, old or compacted,
so a crash at any point recovers a consistent state (a leftover `.tmp` is ignored and
removed by the next rewrite). A failed compaction is logged and the log keeps appending
to the old file.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from kvtier.offload.plan import SlotRecord
from kvtier.storage.manifest_compaction import COMPACT_FLOOR, compaction_due, rewrite_manifest
from kvtier.storage.slot_file import SlotFile, unlink_quietly

__all__ = [
    "MANIFEST_VERSION",
    "ManifestEntry",
    "ManifestError",
    "ManifestIdentity",
    "ManifestLog",
    "check_record",
    "manifest_path_for",
    "open_manifest",
    "read_manifest",
]

logger = logging.getLogger(__name__)

MAGIC = b"KVTMANI1"
MANIFEST_VERSION = 1
_HEADER = struct.Struct("<8sIQQII")  # magic, version, num_slots, slot_bytes, lengths
_RECORD = struct.Struct("<BIIQH")  # kind, slot, num_tokens, data_sum, key_len
_SUM = struct.Struct("<Q")
_PUT, _TOMBSTONE = 1, 2
_MAX_KEY = (1 << 16) - 1
_MAX_TOKENS = (1 << 32) - 1


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
        body = _HEADER.pack(
            MAGIC,
            MANIFEST_VERSION,
            self.num_slots,
            self.bytes_per_slot,
            len(layout),
            len(fingerprint),
        )
        body += layout + fingerprint
        return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


@dataclass(frozen=True)
class ManifestEntry:
    """A live slot: the checksum of its bytes and what they are."""

    checksum: int
    record: SlotRecord


def manifest_path_for(slot_path: str) -> str:
    """Return the manifest path beside the slot file `slot_path`."""
    stem = slot_path[: -len(".slots")] if slot_path.endswith(".slots") else slot_path
    return stem + ".manifest"


def check_record(record: SlotRecord) -> None:
    """Raise ValueError unless `record` fits the record layout."""
    if not isinstance(record.key, bytes) or len(record.key) > _MAX_KEY:
        raise ValueError(f"slot record key must be bytes of at most {_MAX_KEY} B: {record!r}")
    if not 0 <= record.num_tokens <= _MAX_TOKENS:
        raise ValueError(f"slot record num_tokens out of range: {record.num_tokens}")


def _encode_record(kind: int, slot: int, checksum: int, key: bytes, num_tokens: int) -> bytes:
    body = _RECORD.pack(kind, slot, num_tokens, checksum, len(key)) + key
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def _put(slot: int, entry: ManifestEntry) -> bytes:
    record = entry.record
    return _encode_record(_PUT, slot, entry.checksum, record.key, record.num_tokens)


def _tombstone(slot: int) -> bytes:
    return _encode_record(_TOMBSTONE, slot, 0, b"", 0)


def read_manifest(path: str, identity: ManifestIdentity) -> dict[int, ManifestEntry]:
    """Replay the manifest at `path` and return its live slots.

    Raises ManifestError when it cannot be read or its header does not match `identity`.
    A torn or corrupt record ends the replay with a warning.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise ManifestError("the manifest is missing") from exc
    except OSError as exc:
        raise ManifestError(f"cannot open the manifest: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "rb") as file:
            data = memoryview(file.read())
    except OSError as exc:
        raise ManifestError(f"cannot read the manifest: {exc.strerror or exc}") from exc
    offset = _check_header(data, identity)
    return _replay(data, offset, identity.num_slots, path)


def _check_header(data: memoryview, identity: ManifestIdentity) -> int:
    """Return the offset of the first record; raise ManifestError naming the mismatch."""
    if len(data) < _HEADER.size:
        raise ManifestError(f"the manifest is {len(data)} B, shorter than its header")
    magic, version, num_slots, slot_bytes, layout_len, fp_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ManifestError(f"bad magic {bytes(magic)!r}, not a kvtier manifest")
    if version != MANIFEST_VERSION:
        raise ManifestError(f"format version {version}, expected {MANIFEST_VERSION}")
    end = _HEADER.size + layout_len + fp_len
    if len(data) < end + _SUM.size:
        raise ManifestError("the manifest header is cut short")
    (stored_sum,) = _SUM.unpack_from(data, end)
    if stored_sum != xxhash.xxh3_64_intdigest(data[:end]):
        raise ManifestError("the header checksum does not match")
    layout = bytes(data[_HEADER.size : _HEADER.size + layout_len])
    fingerprint = bytes(data[_HEADER.size + layout_len : end])
    if fingerprint != identity.fingerprint.encode():
        raise ManifestError(
            f"fingerprint {_short(fingerprint)} differs from {_short(identity.fingerprint)}"
        )
    for name, stored, expected in (
        ("num_slots", num_slots, identity.num_slots),
        ("bytes_per_slot", slot_bytes, identity.bytes_per_slot),
        ("region layout", layout, identity.region_layout.encode()),
    ):
        if stored != expected:
            raise ManifestError(f"geometry changed: {name} {_short(stored)} != {_short(expected)}")
    return end + _SUM.size


def _short(value: object) -> str:
    if not isinstance(value, (bytes, str)):
        return str(value)
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _replay(data: memoryview, offset: int, num_slots: int, path: str) -> dict[int, ManifestEntry]:
    live: dict[int, ManifestEntry] = {}
    problem = None
    while offset < len(data):
        if len(data) - offset < _RECORD.size:
            problem = "torn record at the end"
            break
        kind, slot, num_tokens, data_sum, key_len = _RECORD.unpack_from(data, offset)
        end = offset + _RECORD.size + key_len
        if len(data) < end + _SUM.size:
            problem = "torn record at the end"
            break
        (stored_sum,) = _SUM.unpack_from(data, end)
        valid_kind = kind in (_PUT, _TOMBSTONE)
        if not valid_kind or stored_sum != xxhash.xxh3_64_intdigest(data[offset:end]):
            problem = "corrupt record"
            break
        if slot >= num_slots:
            problem = f"record for slot {slot} outside [0, {num_slots})"
            break
        if kind == _PUT:
            key = bytes(data[offset + _RECORD.size : end])
            live[slot] = ManifestEntry(data_sum, SlotRecord(key, num_tokens))
        else:
            live.pop(slot, None)
        offset = end + _SUM.size
    if problem is not None:
        logger.warning(
            "disk tier manifest %s: %s at byte %d of %d; ignoring it and every later record",
            path,
            problem,
            offset,
            len(data),
        )
    return live


class ManifestLog:
    """The open manifest, appended to from any thread.

    Appends are best effort: an append that fails is cut off the file again (or, when even
    that fails, the log stops appending for the rest of the run, with a warning). Either
    way a read never returns wrong bytes; at worst a restart misses or fails a slot.

    The log keeps the encoded put record of every live slot (about 180 B of memory per
    live slot with 36-byte keys: ~90 MB for 500k) and counts the records in its file; an
    append after which `compaction_due` holds rewrites the file with the live records
    (see `manifest_compaction`; `compactions` counts these). The rewrite runs under the lock
    that serializes appends, so no record is lost or lands in the replaced file; the cost
    is that an I/O thread appending meanwhile waits for one write and fsync of the
    compacted file (100k live slots: ~6 MB, typically tens of milliseconds on an SSD),
    which happens only after the log has grown to several times its compacted size. A
    failed rewrite is logged, and retried once the log has doubled in records.
    """

    def __init__(
        self,
        path: str,
        header: bytes,
        live: Mapping[int, ManifestEntry],
        compact_floor: int = COMPACT_FLOOR,
    ) -> None:
        """Write the manifest at `path` anew (header and one put record per `live` slot,
        atomically) and open it for appending; raise OSError when that fails."""
        self.path = path
        self._header = header
        self._live = {slot: _put(slot, live[slot]) for slot in sorted(live)}
        self._compact_floor = compact_floor
        self._fd: int | None = None
        self._size = self._records = self._retry_at = self.compactions = 0
        self._broken = False
        self._lock = threading.Lock()
        self._rewrite()

    @property
    def is_open(self) -> bool:
        """Return True until `close()`."""
        return self._fd is not None

    def put(
        self, slots: Sequence[int], checksums: Sequence[int], records: Sequence[SlotRecord]
    ) -> None:
        """Append one put record per slot (call after the slots' data was written)."""
        encoded = [
            (int(slot), _put(int(slot), ManifestEntry(int(checksum), record)))
            for slot, checksum, record in zip(slots, checksums, records, strict=True)
        ]
        data = b"".join(record for _, record in encoded)
        with self._lock:
            if self._append_locked(data, len(encoded)):
                self._live.update(encoded)  # in order: the last record of a slot wins
                self._compact_if_due()

    def forget(self, slots: Iterable[int]) -> None:
        """Append a tombstone for each slot whose last record is a put."""
        with self._lock:
            dead = [s for s in dict.fromkeys(int(s) for s in slots) if s in self._live]
            if dead and self._append_locked(b"".join(map(_tombstone, dead)), len(dead)):
                for slot in dead:
                    del self._live[slot]
                self._compact_if_due()

    def _append_locked(self, data: bytes, num_records: int) -> bool:
        if self._fd is None or self._broken:
            return False
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write: {written} of {len(data)} B")
        except OSError as exc:
            self._undo(exc)
            return False
        self._size += len(data)
        self._records += num_records
        return True

    def _undo(self, exc: OSError) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as undo_exc:
            self._broken = True
            logger.warning(
                "disk tier manifest %s: append failed (%s) and cannot be undone (%s); "
                "recording nothing more in this run",
                self.path,
                exc,
                undo_exc,
            )
            return
        logger.warning("disk tier manifest %s: append failed (%s); record dropped", self.path, exc)

    def _compact_if_due(self) -> None:
        if self._records < self._retry_at or not compaction_due(
            self._records, len(self._live), self._compact_floor
        ):
            return
        try:
            self._rewrite()
        except OSError as exc:
            self._retry_at = 2 * self._records
            logger.warning(
                "disk tier manifest %s: compaction failed (%s); appending to the old log",
                self.path,
                exc,
            )

    def _rewrite(self) -> None:
        """Replace the file with the header and the live records and append to it from
        now on (the caller holds the lock, or is the constructor)."""
        content = self._header + b"".join(self._live.values())
        fd = rewrite_manifest(self.path, content)
        old, self._fd = self._fd, fd
        self._size, self._records = len(content), len(self._live)
        if old is not None:
            self.compactions += 1
            os.close(old)  # the replaced log: no longer reachable by its path

    def close(self) -> None:
        """Flush the log to the device and close it; idempotent."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def open_manifest(
    slot_file: SlotFile, identity: ManifestIdentity, compact_floor: int = COMPACT_FLOOR
) -> tuple[ManifestLog, dict[int, ManifestEntry]]:
    """Open the manifest of the persistent, locked `slot_file` and return it with the live
    slots it recovered.

    A reused slot file is kept when the manifest matches `identity` and the file has its
    exact size; otherwise both are discarded with a warning and the slot file is
    recreated. The manifest is then rewritten atomically with the live records only.
    `compact_floor` is the fewest records at which the log compacts itself during the run
    (see `compaction_due`).
    """
    path = manifest_path_for(slot_file.path)
    live: dict[int, ManifestEntry] = {}
    if slot_file.reused:
        expected = identity.num_slots * identity.bytes_per_slot
        try:
            live = read_manifest(path, identity)
            if slot_file.file_size() != expected:
                raise ManifestError(
                    f"the slot file is {slot_file.file_size()} B, expected {expected} B"
                )
        except ManifestError as exc:
            logger.warning(
                "discarding persistent disk tier %s (manifest %s): %s",
                slot_file.path,
                path,
                exc,
            )
            live = {}
            unlink_quietly(path)
            slot_file.recreate()
    return ManifestLog(path, identity.encode(), live, compact_floor), live
