"""The manifest of a persistent disk tier: what each slot of the slot file holds, and its
recovery when the tier opens.

`kvtier-rank{N}.manifest` lives beside `kvtier-rank{N}.slots`. It is a header followed by
an append-only log of records. The byte layout and encoding are in `manifest_format`, the
open log that appends and compacts is `manifest_log`, the atomic rewrite is in
`manifest_compaction`; this module replays a manifest and decides at open whether to
reuse or discard it.

Rules. A slot's data is written before its put record is appended, and every append is
one `write` call on an O_APPEND descriptor (no fsync per record). Replay applies records
in order, the last record of a slot wins; the first record that is cut short or fails its
checksum ends the replay with a warning (later records are ignored: an ignored record can
only cause a miss). A record never makes a read return wrong bytes: reads are verified
against `data_sum`, so a stale record whose slot was rewritten since (a crash between the
data write and its record, power loss) fails verification instead. Tombstones keep a
restart from offering a slot that is known to be bad or overwritten.

At open (`open_manifest`) the manifest must be a regular file whose header matches the
identity exactly, and the slot file must have the size the header gives; both must be owned by this
user and writable by no one else (files another user could have planted or rewritten
are never trusted, SPEC §7); otherwise both files are discarded and recreated (with a
warning naming the reason). Only the number of slots may differ (`disk_bytes` changed):
the tier keeps its live slots below the new end and the slot file is resized after the
manifest is rewritten. A reused manifest is
compacted at once: the live records are written to a temporary file in the same
directory, fsynced, and renamed over it. When that rewrite fails (a full disk, an I/O
error) the open fails with an OSError naming the file and the manifest is left as it
was: the disk tier needs its disk space to start, and a later open, once there is space,
still recovers the cache.

During a run the log compacts itself the same way, under the lock that serializes the
appends, right after an append that leaves it holding more than 4 records per live slot
and more than 4096 records (`manifest_compaction.compaction_due`); later records go to
the new file. The file at the manifest path is always a complete log, old or compacted,
so a crash at any point recovers a consistent state (a leftover `.tmp` is ignored and
removed by the next rewrite). A failed compaction is logged and the log keeps appending
to the old file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

import xxhash

from kvtier.storage.file_lock import DiskTierBusyError, is_locked, unlink_quietly
from kvtier.storage.fingerprint_diff import describe_difference
from kvtier.storage.manifest_compaction import COMPACT_FLOOR
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
    check_record,
    decode_put,
)
from kvtier.storage.manifest_log import ManifestLog
from kvtier.storage.slot_file import SlotFile

__all__ = [
    "MANIFEST_VERSION",
    "SLOTS_SUFFIX",
    "ManifestEntry",
    "ManifestError",
    "ManifestIdentity",
    "ManifestLog",
    "check_manifest_paths",
    "check_no_persistent_tier",
    "check_record",
    "manifest_path_for",
    "open_manifest",
    "read_manifest",
    "remove_manifest",
]

logger = logging.getLogger(__name__)

SLOTS_SUFFIX = ".slots"
_READ_BUFFER = 1 << 20  # bytes read from the manifest at a time


def manifest_path_for(slot_path: str) -> str:
    """Return the manifest path of the slot file `slot_path`: its name with `.slots`
    replaced by `.manifest` (`kvtier-rank0.slots` -> `kvtier-rank0.manifest`).

    Raises ValueError naming the path unless it ends in `.slots`. That keeps the mapping
    one to one (no two slot files share a manifest: with any name allowed, `x` and
    `x.slots` would) and keeps slot files apart from manifests and their `.tmp` files.
    """
    if not slot_path.endswith(SLOTS_SUFFIX):
        raise ValueError(
            f"a disk tier slot file's name must end in {SLOTS_SUFFIX!r} (its manifest is "
            f"the same name ending in '.manifest'), got {slot_path!r}"
        )
    return slot_path[: -len(SLOTS_SUFFIX)] + ".manifest"


def read_manifest(path: str, identity: ManifestIdentity) -> dict[int, ManifestEntry]:
    """Replay the manifest at `path` and return its live slots.

    Raises ManifestError when it is missing, not a regular file (it is opened without
    waiting, so a FIFO there cannot block), unreadable, or its header does not match
    `identity`. A torn or corrupt record ends the replay with a warning. The file is read
    record by record: memory stays within one read buffer and the live records, however
    large the file.
    """
    live, num_slots = _read_manifest(path, identity)
    if num_slots != identity.num_slots:
        raise ManifestError(f"geometry changed: num_slots {num_slots} != {identity.num_slots}")
    return live


def _read_manifest(path: str, identity: ManifestIdentity) -> tuple[dict[int, ManifestEntry], int]:
    """`read_manifest`, except that the manifest may be of a tier of another number of
    slots: return its live slots below `identity.num_slots` and its number of slots."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise ManifestError("the manifest is missing") from exc
    except OSError as exc:
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


def check_manifest_paths(slot_path: str) -> None:
    """Raise OSError naming the path when a directory is where the manifest of `slot_path`,
    or its temporary file, goes: the tier could neither write nor remove a file there.

    Any other object at those paths is handled where it is met: a manifest that is not a
    regular file is discarded (or, without persistence, removed) and a temporary file
    replaced. A symlink is never followed, so one to a directory is no directory here. A
    directory made there after this check is named the same way by the step it makes
    fail (`open_manifest`, `remove_manifest`).
    """
    error = _directory_error(slot_path)
    if error is not None:
        raise error


def _directory_error(slot_path: str) -> OSError | None:
    """Return the error naming a directory at the manifest paths of `slot_path`, if any."""
    manifest = manifest_path_for(slot_path)
    for path in (manifest, manifest + ".tmp"):
        try:
            is_directory = stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:  # nothing there (or nothing to tell): the step's own error stands
            continue
        if is_directory:
            return OSError(  # EINVAL, as for a slot path that is not a regular file
                errno.EINVAL,
                "disk tier manifest path is a directory, not a regular file; remove it "
                "(the tier writes its manifest there) or give the disk tier another path",
                path,
            )
    return None


@contextlib.contextmanager
def _directories_named(slot_path: str) -> Iterator[None]:
    """Replace an OSError raised inside by the error of `check_manifest_paths` when a
    directory is now at the manifest paths of `slot_path`: one made there after that check
    fails the removal, write or rename of the manifest with a bare IsADirectoryError or
    FileExistsError that does not say what to do."""
    try:
        yield
    except OSError as exc:
        error = _directory_error(slot_path)
        if error is None:
            raise
        raise error from exc


def remove_manifest(slot_path: str) -> None:
    """Remove the manifest of `slot_path` if there is one (a non-persistent tier does, under
    its new slot file's lock: a manifest whose slot file was gone describes nothing, and
    no later persistent run may trust it), and a compaction's leftover `.tmp` with it;
    raise OSError naming the path on failure."""
    manifest = manifest_path_for(slot_path)
    with _directories_named(slot_path):
        unlink_quietly(manifest)
        unlink_quietly(manifest + ".tmp")


def check_no_persistent_tier(slot_path: str) -> None:
    """Raise unless a non-persistent tier may create its slot file at `slot_path`.

    DiskTierBusyError when a persistent tier there is in use by another process or
    worker; FileExistsError when a persistent tier's files are at rest there (starting
    without persistence would replace them).
    """
    manifest = manifest_path_for(slot_path)
    if not (os.path.exists(manifest) and os.path.lexists(slot_path)):
        return
    if is_locked(slot_path):
        raise DiskTierBusyError(
            errno.EBUSY,
            f"a persistent disk tier at this path (manifest {manifest}) is in use by "
            "another process or worker; do not remove its files, give this engine its own "
            "disk path (two engines must not share a disk tier directory for the same rank)",
            slot_path,
        )
    raise FileExistsError(
        errno.EEXIST,
        f"a persistent disk tier is at this path (manifest {manifest}); reuse it with "
        "disk_persist on (the reference engine; the vLLM connector does not persist), "
        "or remove both files, or give this engine another disk path",
        slot_path,
    )


def open_manifest(
    slot_file: SlotFile, identity: ManifestIdentity, compact_floor: int = COMPACT_FLOOR
) -> tuple[ManifestLog, dict[int, ManifestEntry]]:
    """Open the manifest of the persistent, locked `slot_file` and return it with the live
    slots it recovered.

    A reused slot file is kept when the manifest matches `identity` and the file has its
    exact size; otherwise both are discarded with a warning and the slot file is
    recreated. The manifest is then rewritten atomically with the live records only; an
    OSError naming the file (a full disk, an I/O error; a directory made at the manifest
    paths after `check_manifest_paths`: its error) leaves it as it was and is raised, with
    no manifest left open. `compact_floor` is the fewest records at which the log compacts
    itself during the run (see `compaction_due`).
    """
    with _directories_named(slot_file.path):
        return _open_manifest(slot_file, identity, compact_floor)


def _open_manifest(
    slot_file: SlotFile, identity: ManifestIdentity, compact_floor: int
) -> tuple[ManifestLog, dict[int, ManifestEntry]]:
    path = manifest_path_for(slot_file.path)
    live: dict[int, ManifestEntry] = {}
    resized_from = None
    if slot_file.reused:
        try:
            untrusted = trust_problem(slot_file.status(), "the slot file")
            if untrusted:
                raise ManifestError(untrusted)
            live, num_slots = _read_manifest(path, identity)
            expected = num_slots * identity.bytes_per_slot  # the size the manifest was for
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
        else:
            if num_slots != identity.num_slots:
                resized_from = num_slots
    log = ManifestLog(path, identity.encode(), live, compact_floor)
    if resized_from is not None:
        try:
            _resize(slot_file, resized_from, len(live))
        except BaseException:
            log.close()
            raise
    return log, live


def _resize(slot_file: SlotFile, old_num_slots: int, num_kept: int) -> None:
    """Size a reused slot file written for `old_num_slots` to the tier's number of slots.

    Called once the manifest was rewritten for the new number (with the live slots below
    it only): a failed rewrite leaves both files as they were, for a later open. A crash
    between the two leaves a slot file of the wrong size, which the next open discards.
    """
    slot_file.resize()
    logger.warning(
        "disk tier %s resized from %d to %d slots (disk_bytes changed); kept %d cached blocks%s",
        slot_file.path,
        old_num_slots,
        slot_file.num_slots,
        num_kept,
        " (the slots past the new end are dropped)" if slot_file.num_slots < old_num_slots else "",
    )
