"""Reading a persistent disk tier's manifest (see `manifest`): the header checked
against this tier's identity, then the records replayed into the live slots.

Replay applies records in order, the last record of a slot wins; the first record that
is cut short or fails its checksum ends the replay with a warning (later records are
ignored: an ignored record can only cause a miss). Files another user could have written
are never trusted (`trust_problem`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import BinaryIO

import xxhash

from kvtier.storage.fingerprint_diff import describe_difference
from kvtier.storage.manifest_format import (
    CHECKSUM,
    HEADER,
    MAGIC,
    MANIFEST_VERSION,
    PUT,
    RECORD,
    TAGGED_PUT,
    TOMBSTONE,
    ManifestEntry,
    ManifestError,
    ManifestIdentity,
    decode_put,
)

logger = logging.getLogger("kvtier.storage.manifest")  # one logger for the manifest's warnings
_READ_BUFFER = 1 << 20  # bytes read from the manifest at a time
# Errors of this process's limits, not of the files: the open fails and the tier is kept
# for a later one (anything else that stops the reading discards it).
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def read_manifest(path: str, identity: ManifestIdentity) -> dict[int, ManifestEntry]:
    """Replay the manifest at `path` and return its live slots.

    Raises ManifestError when it is missing, not a regular file (it is opened without
    waiting, so a FIFO there cannot block), unreadable, or its header does not match
    `identity`. A torn or corrupt record ends the replay with a warning. The file is read
    record by record: memory stays within one read buffer and the live records, however
    large the file.
    """
    live, num_slots = read_manifest_any_size(path, identity)
    if num_slots != identity.num_slots:
        raise ManifestError(f"geometry changed: num_slots {num_slots} != {identity.num_slots}")
    return live


def read_manifest_any_size(
    path: str, identity: ManifestIdentity
) -> tuple[dict[int, ManifestEntry], int]:
    """`read_manifest`, except that the manifest may be of a tier of another number of
    slots: return its live slots below `identity.num_slots` and its number of slots."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise ManifestError("the manifest is missing") from exc
    except OSError as exc:
        if exc.errno in _OUT_OF_RESOURCES:  # nothing wrong with the files: keep them
            raise OSError(exc.errno, f"cannot open the manifest: {exc.strerror}", path) from exc
        raise ManifestError(f"cannot open the manifest: {exc.strerror or exc}") from exc
    file = None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ManifestError("the manifest is not a regular file")
        untrusted = trust_problem(info, "the manifest")
        if untrusted:
            raise ManifestError(untrusted)
        os.set_blocking(fd, True)
        file = os.fdopen(fd, "rb", buffering=_READ_BUFFER)
        offset, num_slots = _check_header(file, info.st_size, identity)
        live = _replay(file, info.st_size, offset, num_slots, identity.num_slots, path)
        return live, num_slots
    except OSError as exc:
        if exc.errno in _OUT_OF_RESOURCES:
            raise OSError(exc.errno, f"cannot read the manifest: {exc.strerror}", path) from exc
        raise ManifestError(f"cannot read the manifest: {exc.strerror or exc}") from exc
    finally:
        if file is not None:
            file.close()
        else:
            os.close(fd)


def trust_problem(info: os.stat_result, what: str) -> str | None:
    """Return why a reused file described by `info` cannot be trusted, or None.

    Its bytes are served as KV: a file owned by another user, or one that group or
    others may write, could hold KV of someone else's choosing (the checksums are in the
    manifest, which such a user can write as well)."""
    if info.st_uid != os.geteuid():
        return f"{what} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(info.st_mode):#o})"
    return None


def _check_header(file: BinaryIO, size: int, identity: ManifestIdentity) -> tuple[int, int]:
    """Return the offset of the first record and the tier's number of slots (which may
    differ from `identity`'s: `disk_bytes` changed); raise ManifestError naming any other
    mismatch."""
    head = file.read(HEADER.size)
    if len(head) < HEADER.size:
        raise ManifestError(f"the manifest is {size} B, shorter than its header")
    magic, version, num_slots, slot_bytes, layout_len, fp_len = HEADER.unpack(head)
    if magic != MAGIC:
        raise ManifestError(f"bad magic {bytes(magic)!r}, not a kvtier manifest")
    if version != MANIFEST_VERSION:
        raise ManifestError(f"format version {version}, expected {MANIFEST_VERSION}")
    header_size = HEADER.size + layout_len + fp_len + CHECKSUM.size
    expected_size = len(identity.encode())
    if header_size > max(expected_size, _READ_BUFFER):  # cannot match; do not read it
        raise ManifestError(f"the header claims {header_size} B, this tier's is {expected_size} B")
    rest = file.read(header_size - HEADER.size)
    if len(rest) < header_size - HEADER.size:
        raise ManifestError("the manifest header is cut short")
    data = head + rest
    end = header_size - CHECKSUM.size
    (stored_sum,) = CHECKSUM.unpack_from(data, end)
    if stored_sum != xxhash.xxh3_64_intdigest(data[:end]):
        raise ManifestError("the header checksum does not match")
    layout = data[HEADER.size : HEADER.size + layout_len]
    fingerprint = data[HEADER.size + layout_len : end]
    if fingerprint != identity.fingerprint.encode():
        written_with = fingerprint.decode(errors="replace")
        raise ManifestError(describe_difference(written_with, identity.fingerprint))
    for name, stored, expected in (
        ("bytes_per_slot", slot_bytes, identity.bytes_per_slot),
        ("region layout", layout, identity.region_layout.encode()),
    ):
        if stored != expected:
            raise ManifestError(f"geometry changed: {name} {_short(stored)} != {_short(expected)}")
    if num_slots <= 0:
        raise ManifestError(f"the header claims {num_slots} slots")
    return header_size, num_slots


def _short(value: object) -> str:
    if not isinstance(value, (bytes, str)):
        return str(value)
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _replay(
    file: BinaryIO, size: int, offset: int, num_slots: int, keep_below: int, path: str
) -> dict[int, ManifestEntry]:
    """Return the live slots below `keep_below` (a tier shrunk since: the slots past its
    new end are cut off) of the records from `offset` on."""
    live: dict[int, ManifestEntry] = {}
    problem = None
    while head := file.read(RECORD.size):
        if len(head) < RECORD.size:
            problem = "torn record at the end"
            break
        kind, slot, num_tokens, data_sum, key_len = RECORD.unpack(head)
        tail = file.read(key_len + CHECKSUM.size)
        if len(tail) < key_len + CHECKSUM.size:
            problem = "torn record at the end"
            break
        key = tail[:key_len]
        (stored_sum,) = CHECKSUM.unpack_from(tail, key_len)
        valid_kind = kind in (PUT, TAGGED_PUT, TOMBSTONE)
        if not valid_kind or stored_sum != xxhash.xxh3_64_intdigest(head + key):
            problem = "corrupt record"
            break
        if slot >= num_slots:
            problem = f"record for slot {slot} outside [0, {num_slots})"
            break
        if slot >= keep_below:
            pass  # past the end of a shrunk tier
        elif kind == TOMBSTONE:
            live.pop(slot, None)
        else:
            record = decode_put(kind, key, num_tokens)
            if record is None:
                problem = "tagged record too short for its tag"
                break
            live[slot] = ManifestEntry(data_sum, record)
        offset += len(head) + len(tail)
    if problem is not None:
        logger.warning(
            "disk tier manifest %s: %s at byte %d of %d; ignoring it and every later record",
            path,
            problem,
            offset,
            size,
        )
    return live
