"""Reading a manifest's records (see `manifest_read`): decoding the record at an offset,
and the scan for the next valid record after a corrupt one.

`RecordReader` reads the records after the header through a window of the file: one
read (`READ_BUFFER`, 1 MiB) plus the rest of the previous window not yet decoded, so
memory stays within a few buffers however large the file, and the records are decoded
straight from the window in one loop (`apply_run`: no read call, method call or tuple
per record: 200k records replay about 20 % faster than with two reads per record).

A *valid record* (`RecordReader.record_at`) lies whole within the file, its checksum
matches its bytes, its kind is put, tombstone or tagged put, its slot is below the
header's number of slots, and a tagged put's key field holds the 16-byte tag. After an
invalid one, `RecordReader.next_record` looks for the next offset at which a valid record
starts. Records have no sync marker (their length depends on `key_len`), so any byte may
start one: the scan first keeps, with numpy over a span of the window at once, the
offsets whose byte is a valid kind, whose slot field is below the number of slots and
whose length fits in the file, and checks only those in Python, in order. The span is
4 KiB at first and doubles up to the whole window, so a resync costs about the distance
to the next valid record, however many corrupt records the file holds. Random bytes
leave 3/256 x num_slots/2**32 of the offsets to check (one in 350 000 with a million
slots), zeros none, and a run of one kind byte (0x01 0x01 ..., the most offsets of a
valid kind) none either below 16 843 010 slots; the first pass compares the kind and the
slot's top byte with whole-span slices, so only offsets that pass both are gathered.
Crafted bytes can make every 5th offset pass these filters; of a repeating pattern (a
key of such bytes behind a damaged record), past the first 64 candidates of a resync,
only those that do not repeat one just before them are checked (`_check_order`: the
fingerprints cost a resync that stops at one of the first, the usual case, nothing),
and each check starts with the record's checksum, before `record_at` decodes it: a
damaged MiB of the pattern of 8 bytes scans in ~23 ms of CPU instead of ~120 ms;
candidates all distinct still cost about 0.7 us each (~90 ms per MiB of one every 8
bytes).
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

import numpy as np
import xxhash

from kvtier.core.token_tags import TAG_SIZE
from kvtier.offload.plan import SlotRecord
from kvtier.storage.manifest_format import (
    CHECKSUM,
    PUT,
    RECORD,
    TAGGED_PUT,
    TOMBSTONE,
    ManifestEntry,
    decode_put,
)

__all__ = ["READ_BUFFER", "Decoded", "Invalid", "RecordReader"]

READ_BUFFER = 1 << 20  # bytes read from the manifest at a time
_PAGE = 4096  # after a read failed with EIO, the file is read again a page at a time
# More unreadable bytes than this and the disk is failing: the replay fails (the tier is
# discarded) rather than wait out a failed read, which may take seconds, per page.
_MAX_UNREADABLE = 256 * _PAGE
_DIGEST = xxhash.xxh3_64_intdigest
_KINDS = (PUT, TOMBSTONE, TAGGED_PUT)
_MIN_RECORD = RECORD.size + CHECKSUM.size  # a record with an empty key field: a tombstone
_FIRST_SCAN = 4096  # offsets the scan filters at first; doubled each pass, up to a window
# The candidates of a resync checked one by one before repeated records are checked
# once (`_check_order`), and how many of the rest are deduplicated at a time.
_DEDUPE_FROM, _DEDUPE_BATCH = 64, 1024
_REPEAT_LAG = 16  # a candidate is compared with this many candidates before it
# The fingerprint of record bytes (`_first_of_repeats`): an odd base and its inverse.
_FINGERPRINT_BASE = 0x9E3779B97F4A7C15
_FINGERPRINT_INVERSE = pow(_FINGERPRINT_BASE, -1, 1 << 64)
# Offsets in a record of the slot (u32, after the kind) and of key_len (u16, after the
# kind, slot, num_tokens and data_sum).
_SLOT_AT, _KEY_LEN_AT = struct.calcsize("<B"), struct.calcsize("<BIIQ")

# A record decoded: its slot, the entry of a put (None: a tombstone), and where it ends.
Decoded = tuple[int, ManifestEntry | None, int]


class Invalid(NamedTuple):
    """Why no valid record starts at an offset."""

    reason: str  # naming the bad value
    past_end: bool  # the record would run past the end of the file (a torn append)
    # Where a well-formed record ends (its checksum matches) that cannot be applied: an
    # unknown kind (a later format's), a slot past the end, a tagged put without its tag.
    # None: the bytes are not a record (damaged, torn).
    record_end: int | None = None


class RecordReader:
    """The records of a manifest file from an offset on, read forward through a window.

    `apply_run` replays the records the window holds, `record_at` decodes (or rejects)
    one record, reading what the window lacks, and `next_record` scans for the next
    valid one. Each takes a file offset at or after the previous one's: the window keeps
    the bytes from the offset last read at and drops those before it.
    """

    def __init__(self, file: BinaryIO, start: int, size: int, num_slots: int) -> None:
        """Read `file` (positioned at `start`, `size` bytes long) whose header says
        `num_slots` slots."""
        self._file = file
        self._size = size
        self._num_slots = num_slots
        self._data = b""  # file bytes [_base, _base + len(_data)); the file is read up to there
        self._base = start
        self.unreadable_bytes = 0  # bytes of pages whose read failed (EIO), read as zeros

    @property
    def size(self) -> int:
        """Return the size of the file (less when it turned out shorter than its stat)."""
        return self._size

    def record_at(self, pos: int) -> Decoded | Invalid:
        """Return the valid record at file offset `pos`, or why there is none there."""
        i = pos - self._base
        if i + RECORD.size > len(self._data) and not self._fill(pos, RECORD.size):
            return Invalid(f"{self._size - pos} B left, less than a record's head", True)
        data, i = self._data, pos - self._base
        kind, slot, num_tokens, data_sum, key_len = RECORD.unpack_from(data, i)
        sum_at = i + RECORD.size + key_len
        if sum_at + CHECKSUM.size > len(data):
            if not self._fill(pos, sum_at + CHECKSUM.size - i):
                return Invalid(f"key_len {key_len} runs past the end of the file", True)
            data, i = self._data, pos - self._base
            sum_at = i + RECORD.size + key_len
        (stored_sum,) = CHECKSUM.unpack_from(data, sum_at)
        if stored_sum != xxhash.xxh3_64_intdigest(data[i:sum_at]):
            return Invalid("checksum mismatch", False)
        end = pos + RECORD.size + key_len + CHECKSUM.size
        if kind not in _KINDS:
            return Invalid(f"unknown kind {kind}", False, end)
        entry: ManifestEntry | None = None  # a tombstone
        if kind != TOMBSTONE:
            record = decode_put(kind, data[i + RECORD.size : sum_at], num_tokens)
            if record is None:
                why = f"tagged put too short for its tag: key field of {key_len} B"
                return Invalid(why, False, end)
            entry = ManifestEntry(data_sum, record)
        if slot >= self._num_slots:
            return Invalid(f"slot {slot} outside [0, {self._num_slots})", False, end)
        return slot, entry, end

    def apply_run(self, pos: int, live: dict[int, ManifestEntry], keep_below: int) -> int:
        """Apply to `live` the records from `pos` on while they are valid and lie whole in
        the window (the last record of a slot wins; a slot from `keep_below` on is left
        out); return the offset of the first one not applied: past the window's end, or
        one `record_at` must decode or reject.

        The hot loop of a replay, for the common case only: it accepts a subset of what
        `record_at` accepts (same checks), without a call or a tuple per record."""
        data, base, num_slots = self._data, self._base, self._num_slots
        unpack, unpack_sum, digest = RECORD.unpack_from, CHECKSUM.unpack_from, _DIGEST
        head, tail, end = RECORD.size, CHECKSUM.size, len(self._data)
        i = pos - base
        while i + head <= end:
            kind, slot, num_tokens, data_sum, key_len = unpack(data, i)
            sum_at = i + head + key_len
            if sum_at + tail > end or slot >= num_slots:
                break
            if unpack_sum(data, sum_at)[0] != digest(data[i:sum_at]):
                break
            if kind == PUT:
                record = SlotRecord(data[i + head : sum_at], num_tokens)
            elif kind == TOMBSTONE:
                if slot < keep_below:
                    live.pop(slot, None)
                i = sum_at + tail
                continue
            elif kind == TAGGED_PUT and key_len >= TAG_SIZE:
                record = SlotRecord(
                    data[i + head : sum_at - TAG_SIZE], num_tokens, data[sum_at - TAG_SIZE : sum_at]
                )
            else:
                break
            if slot < keep_below:
                live[slot] = ManifestEntry(data_sum, record)
            i = sum_at + tail
        return base + i

    def next_record(self, start: int) -> int | None:
        """Return the first offset from `start` on at which a valid record starts, or None
        when none does before the end of the file."""
        pos, span = start, _FIRST_SCAN
        alone = _DEDUPE_FROM  # candidates checked before repeats are left out (first pass)
        while self._fill(pos, _MIN_RECORD):
            data, base = self._data, self._base
            # The offsets whose head is in the window, at most `span` of them: the next
            # valid record is usually a few bytes on, and filtering the whole window at
            # every resync made a file of many corrupt records quadratic to replay.
            stop = min(len(data) - RECORD.size + 1, pos - base + span)
            room, whole = self._size - base, len(data)
            unpack_sum, digest = CHECKSUM.unpack_from, _DIGEST
            at, ends = _candidates(data, pos - base, stop, self._num_slots, room)
            for i, end in _check_order(data, at, ends, alone):
                # Most candidates fail their checksum: checked here first, a third of
                # the time `record_at` takes to reject them.
                sum_at = end - CHECKSUM.size
                if end <= whole and unpack_sum(data, sum_at)[0] != digest(data[i:sum_at]):
                    continue
                if not isinstance(self.record_at(base + i), Invalid):
                    return base + i
            pos, span, alone = base + stop, min(2 * span, READ_BUFFER), 0
        return None

    def _fill(self, pos: int, need: int) -> bool:
        """Make the window hold file bytes [pos, pos + need), reading what it lacks;
        return False when the file ends first."""
        if pos + need > self._size:
            return False
        data, base = self._data, self._base
        if pos + need <= base + len(data):
            return True
        assert pos >= base, f"the reader went back from byte {base} to {pos}"
        if pos > base + len(data):  # past the window: the bytes between are not needed
            self._file.seek(pos)
        kept = data[pos - base :]
        want = max(READ_BUFFER, need - len(kept))
        try:
            more = self._file.read(want)
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            more = self._read_around_errors(pos + len(kept), want)
        self._data, self._base = kept + more if kept else more, pos
        if len(self._data) < need:  # shorter than its stat said: it ends here
            self._size = pos + len(self._data)
            return False
        return True

    def _read_around_errors(self, start: int, want: int) -> bytes:
        """Read up to `want` bytes from file offset `start` a page at a time, after a
        read there failed with EIO (an unreadable sector): a page that fails again reads
        as zeros. No record starts in zeros and none that overlaps them passes its
        checksum, so the replay skips exactly the records the unreadable pages touch.
        Each page is one `pread` (the buffered file would read ahead into the next bad
        page); past `_MAX_UNREADABLE` unreadable bytes the EIO is raised."""
        parts: list[bytes] = []
        fd = self._file.fileno()
        at, end = start, min(start + want, self._size)
        while at < end:
            length = min(_PAGE - at % _PAGE, end - at)
            try:
                chunk = os.pread(fd, length, at)
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                self.unreadable_bytes += length
                if self.unreadable_bytes > _MAX_UNREADABLE:
                    raise
                chunk = bytes(length)
            parts.append(chunk)
            at += len(chunk)
            if len(chunk) < length:  # the file ends here
                break
        self._file.seek(at)
        return b"".join(parts)


def _candidates(
    data: bytes, lo: int, hi: int, num_slots: int, room: int
) -> tuple[np.ndarray, np.ndarray]:
    """Return the offsets in [lo, hi) of `data` where a valid record may start, ascending,
    and where each record would end: a valid kind byte, a slot field below `num_slots`,
    and a length within `room` bytes of `data`'s start. Every offset in [lo, hi) must
    have a whole record head in `data`."""
    raw = np.frombuffer(data, dtype=np.uint8)
    kinds = raw[lo:hi]
    top = raw[lo + _SLOT_AT + 3 : hi + _SLOT_AT + 3]  # the slot's most significant byte
    maybe = (kinds == _KINDS[0]) | (kinds == _KINDS[1]) | (kinds == _KINDS[2])
    at = np.flatnonzero(maybe & (top <= min((num_slots - 1) >> 24, 255)))
    if len(at) == 0:
        return at, at
    at += lo
    slot = np.zeros(len(at), dtype=np.int64)
    for k in range(4):
        slot |= raw[at + _SLOT_AT + k].astype(np.int64) << (8 * k)
    low, high = raw[at + _KEY_LEN_AT], raw[at + _KEY_LEN_AT + 1]
    key_len = low.astype(np.int64) | high.astype(np.int64) << 8
    ends = at + (_MIN_RECORD + key_len)
    keep = (slot < num_slots) & (ends <= room)
    return at[keep], ends[keep]


def _check_order(
    data: bytes, at: np.ndarray, ends: np.ndarray, alone: int
) -> Iterator[tuple[int, int]]:
    """Yield the candidates (`_candidates`: offsets `at` in `data`, ascending, and their
    records' ends) the scan checks, in order: the first `alone` all, then a batch of
    `_DEDUPE_BATCH` at a time less its repeats (`_first_of_repeats`).

    Lazily: the scan stops at the first valid one, usually among the first few of a
    resync (a damaged record followed by valid ones), so the fingerprints are computed
    only for a resync through many invalid candidates, and over one batch's bytes at a
    time (a few MiB of arrays at most, not 40 bytes per byte of the window)."""
    yield from zip(at[:alone].tolist(), ends[:alone].tolist(), strict=True)
    raw = np.frombuffer(data, dtype=np.uint8)
    for first in range(alone, len(at), _DEDUPE_BATCH):
        batch = slice(first, first + _DEDUPE_BATCH)
        kept, kept_ends = _first_of_repeats(raw, at[batch], ends[batch])
        yield from zip(kept.tolist(), kept_ends.tolist(), strict=True)


def _first_of_repeats(
    raw: np.ndarray, at: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Return the offsets `at` (ascending; a candidate record spans [at, end) of `raw`)
    less those whose record bytes repeat those of one of the `_REPEAT_LAG` candidates
    before it, when at least `_DEDUPE_FROM` records lie whole in `raw`.

    Whether a record is valid depends on its bytes alone (it lies in the file: checked
    before), so a repeat is valid exactly when the earlier one is, which is checked
    first: leaving repeats out changes no resync. Damaged bytes of a repeating pattern
    (a key of crafted bytes: a candidate every 8 bytes) then cost one check per
    distinct candidate of a period, not ~1 us of Python per candidate. Repeats are
    found by a polynomial fingerprint of each record's bytes (mod 2**64, from prefix
    sums). Two records whose fingerprints collide (about 2**-64 for bytes not built to
    collide) are taken for one and the later is skipped unchecked: at worst a lost
    record, which, like a damaged one, is only a miss (see `manifest_read`).
    """
    whole = ends <= len(raw)  # past the window: checked as it comes
    if np.count_nonzero(whole) < _DEDUPE_FROM:
        return at, ends
    lo, hi = int(at[0]), int(ends[whole].max())
    steps = np.full(hi - lo, _FINGERPRINT_BASE, dtype=np.uint64)
    steps[0] = 1
    powers = np.cumprod(steps)  # base**t, wrapping mod 2**64
    steps.fill(_FINGERPRINT_INVERSE)
    steps[0] = 1
    inverses = np.cumprod(steps)
    terms = raw[lo:hi].astype(np.uint64)
    terms += 1  # a longer record differs from a shorter one by nonzero terms
    terms *= powers
    prefix = np.zeros(hi - lo + 1, dtype=np.uint64)
    np.cumsum(terms, out=prefix[1:])
    first, last = at[whole] - lo, ends[whole] - lo
    prints = (prefix[last] - prefix[first]) * inverses[first]
    # A repeat of one of the `_REPEAT_LAG` candidates before it (a pattern of up to that
    # many distinct candidates per period); comparing with all earlier ones needs a
    # sort, which costs more than the checks it saves.
    repeat = np.zeros(len(prints), dtype=bool)
    for lag in range(1, min(_REPEAT_LAG, len(prints) - 1) + 1):
        repeat[lag:] |= prints[lag:] == prints[:-lag]
    keep = ~whole
    keep[np.flatnonzero(whole)[~repeat]] = True
    return at[keep], ends[keep]
