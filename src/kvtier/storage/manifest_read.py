"""Reading a persistent disk tier's manifest (see `manifest`): the header checked
against this tier's identity, then the records replayed into the live slots.

Replay applies records in order, the last record of a slot wins. A well-formed record
(its checksum matches) that cannot be applied (`manifest_scan`: an unknown kind, a slot
past the header's number of slots, a tagged put without its tag) is skipped by its
length, with a warning. Any other record that is not valid (it fails its checksum, or
its `key_len` runs past the end of the file) is skipped too: the replay scans forward
for the next offset at which a valid record starts and resumes there, so damaged bytes
in the middle of the file (bit rot, a stray write) cost only the records they touch,
not every record after it; so do unreadable sectors (a read that
fails with EIO is read again a page at a time, and the pages that still fail count as
damaged bytes, up to 1 MiB: more, or one in the header's page, discards the tier). When
no valid record follows, the replay ends: a record cut short at the very end (a crash
while appending) is ignored. Each skipped region is one warning naming its offset, the
file's size and the bytes skipped (the first `_MAX_WARNINGS` regions; one more line
counts the rest). The open then rewrites the manifest with the live slots, so what was
skipped is gone for good.

Why skipping a record is safe: it can only bring back an earlier state of its slot, and
no state of a slot can make a load serve wrong bytes. Every live entry carries the
xxh3-64 checksum of its slot's bytes (`data_sum`), and every load verifies the bytes it
read against it before any is copied out (`DiskTier._verify`, run by `SlotRead.result`):
a mismatch fails the load (the tokens are recomputed) and tombstones the slot.

- A skipped put: the slot's earlier put (an older key) or nothing is live again. The
  slot holds the skipped put's bytes or later ones, so a load of the older key fails
  its checksum, unless they are exactly the bytes the older put recorded: its KV.
- A skipped tombstone: the slot's earlier put is live again. A tombstone is appended
  before a slot is rewritten without a record, after a failed write and after a failed
  verification; the slot's bytes then either still match the put's checksum (they are
  its KV) or fail the load.

At worst a miss, as for the stale records the format already allows (a crash between a
slot's write and its record). The same holds for a record the scan finds inside a
damaged region: garbage passes the 64-bit checksum with odds of 2**-64, and a record
embedded in a damaged record's key bytes is a real but stale one. The scan runs only
after a record failed its checksum or was cut short: in an undamaged file each record
is read where the previous one ends, so bytes inside a well-formed record's key (one of
a later format's kinds included) are never taken for a record, nor scanned (a key of
crafted bytes, a candidate record every 8 bytes, costs a scan more than clean records:
see `manifest_scan`).

Files another user could have written are never trusted (`trust_problem`).
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
    ManifestEntry,
    ManifestError,
    ManifestIdentity,
)
from kvtier.storage.manifest_scan import READ_BUFFER, Invalid, RecordReader

logger = logging.getLogger("kvtier.storage.manifest")  # one logger for the manifest's warnings
_MAX_WARNINGS = 5  # skipped regions of one replay named one by one; then one summary
# Errors of this process's limits, not of the files: the open fails and the tier is kept
# for a later one (anything else that stops the reading discards it).
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def read_manifest(path: str, identity: ManifestIdentity) -> dict[int, ManifestEntry]:
    """Replay the manifest at `path` and return its live slots.

    Raises ManifestError when it is missing, not a regular file (it is opened without
    waiting, so a FIFO there cannot block), unreadable, or its header does not match
    `identity`. An invalid record is skipped with a warning, and the replay resumes at
    the next valid one (see the module docstring). The file is read a buffer at a time:
    memory stays within a few read buffers and the live records, however large the file.
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
        file = os.fdopen(fd, "rb", buffering=READ_BUFFER)
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
    if header_size > max(expected_size, READ_BUFFER):  # cannot match; do not read it
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
    new end are cut off) of the records from `offset` on.

    An invalid record is skipped: replay resumes at the next valid one (see the module
    docstring), with a warning per skipped region (`_Skips`)."""
    reader = RecordReader(file, offset, size, num_slots)
    skips = _Skips(path)
    live: dict[int, ManifestEntry] = {}
    pos = offset
    while pos < reader.size:
        pos = reader.apply_run(pos, live, keep_below)
        if pos >= reader.size:
            break
        decoded = reader.record_at(pos)  # refills the window, or names what is wrong
        if isinstance(decoded, Invalid):
            resume = decoded.record_end  # a well-formed record: skipped by its length
            if resume is None:
                resume = reader.next_record(pos + 1)
            elif resume >= reader.size:
                resume = None  # it was the last record
            skips.note(decoded, pos, resume, reader.size)
            if resume is None:
                break
            pos = resume
            continue
        slot, entry, pos = decoded
        if slot >= keep_below:
            pass  # past the end of a shrunk tier
        elif entry is None:
            live.pop(slot, None)
        else:
            live[slot] = entry
    skips.summarize()
    if reader.unreadable_bytes:
        logger.warning(
            "disk tier manifest %s: %d bytes could not be read (I/O error) and were skipped "
            "with the records they held",
            path,
            reader.unreadable_bytes,
        )
    return live


# How the summary counts each kind of skipped region (`_Skips.note`'s phrase for it):
# singular, plural. Only damaged bytes are corrupt: a record that cannot be applied is
# well-formed (a later format's kind, say), and a torn record ends the file.
_SUMMARY_PHRASES = {
    "corrupt record": ("region of damaged bytes", "regions of damaged bytes"),
    "record that cannot be applied": (
        "well-formed record that cannot be applied",
        "well-formed records that cannot be applied",
    ),
    "torn record at the end": ("torn record at the end", "torn records at the end"),
}


class _Skips:
    """The warnings of one replay about the records it skipped: one per skipped region,
    the first `_MAX_WARNINGS` of them, then one line counting the rest."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._count = 0  # skipped regions
        self._unnamed_bytes = 0  # bytes of the regions past the first _MAX_WARNINGS
        # Those regions by what they were (`note`'s phrase), in the order first seen.
        self._unnamed: dict[str, int] = {}

    def note(self, invalid: Invalid, pos: int, resume: int | None, size: int) -> None:
        """Warn that no valid record starts at `pos` of a `size`-byte file (`invalid`
        says why) and that replay resumed at `resume` (None: no valid record after it)."""
        self._count += 1
        what = "corrupt record"
        if invalid.record_end is not None:
            what = "record that cannot be applied"
        elif resume is None and invalid.past_end:
            what = "torn record at the end"
        if self._count > _MAX_WARNINGS:
            self._unnamed_bytes += (invalid.record_end or resume or size) - pos
            self._unnamed[what] = self._unnamed.get(what, 0) + 1
            return
        if invalid.record_end is not None:
            outcome = f"skipped its {invalid.record_end - pos} bytes"
            if resume is not None:
                outcome += f", to the record after it, at byte {resume}"
        elif what == "torn record at the end":
            outcome = "ignoring it"
        elif resume is None:
            outcome = f"no valid record after it, ignoring the last {size - pos} bytes"
        else:
            outcome = f"skipped {resume - pos} bytes to the next valid record, at byte {resume}"
        logger.warning(
            "disk tier manifest %s: %s at byte %d of %d; %s (%s)",
            self._path,
            what,
            pos,
            size,
            outcome,
            invalid.reason,
        )

    def summarize(self) -> None:
        """Warn once about the skipped regions not named one by one, counting each kind
        (damaged bytes, well-formed records that cannot be applied, a torn last record)."""
        if self._count > _MAX_WARNINGS:
            kinds = ", ".join(
                f"{count} {_SUMMARY_PHRASES[what][count > 1]}"
                for what, count in self._unnamed.items()
            )
            more = self._count - _MAX_WARNINGS
            logger.warning(
                "disk tier manifest %s: %d more %s skipped (%s; %d bytes in all), "
                "%d in this replay; only the first %d are named",
                self._path,
                more,
                "regions" if more > 1 else "region",
                kinds,
                self._unnamed_bytes,
                self._count,
                _MAX_WARNINGS,
            )
