"""Mooncake-format request traces: reading, validating and writing (one JSON object a line).

A record holds `timestamp` (ms from the start of the trace), `input_length` and
`output_length` (tokens) and `hash_ids`: one id per `block_size`-token block of the
prompt, the last one possibly partial. Ids are chained prefix hashes: equal ids at the
same position mean an equal prompt prefix up to the end of that block, so an id never
repeats within a record and always follows the same id (or always starts a prompt).
Ids must fit in 64 bits (the replay's keys are their 8 bytes).
A gzip-compressed trace is read as is.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvtier.replay.trace_values import value_as_written
from kvtier.replay.whole_file import whole_file

DEFAULT_BLOCK_SIZE = 512
# The largest block size a trace may be read (`kvtier replay --block-size`) or written
# (`generate --block-size`) at, in tokens: longer than any prompt the generator's
# defaults make and 2048 times the Mooncake trace's 512. Larger ones are a typo: every
# prompt is then one block, and the mismatch was only found after reading the trace.
MAX_BLOCK_SIZE = 1 << 20
MAX_HASH_ID = 1 << 64  # ids become 8-byte little-endian keys
_GZIP_MAGIC = b"\x1f\x8b"
# A record's line is at most this long: 2^20 tokens in blocks of 16 take ~1.3 MB of ids.
# Reading stops there, so an input with no newline (/dev/zero) ends with an error.
MAX_LINE_BYTES = 64 << 20
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace record is malformed; the message names the file and line (or, for records
    handed to the replay directly, the record's index)."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, index: int, block_size: int) -> int:
        """Return how many prompt tokens block `index` covers (the last may be partial)."""
        return min(block_size, self.input_length - index * block_size)


def parse_record(line: str, block_size: int, where: str) -> TraceRecord:
    """Parse and validate one JSON line; raise `TraceError` naming `where` on any problem."""
    try:
        raw = json.loads(line, object_pairs_hook=_unique_fields)
    except _RepeatedFieldError as exc:
        raise TraceError(f"{where}: field {exc.args[0]!r} given twice") from None
    except RecursionError:
        raise TraceError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of too many digits
        message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise TraceError(f"{where}: not valid JSON ({message})") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object, got {value_as_written(line, raw)}")
    missing = [name for name in _FIELDS if name not in raw]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    for name in _FIELDS[:3]:
        value = raw[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            written = value_as_written(line, raw, name)
            raise TraceError(f"{where}: {name} must be an int >= 0, got {written}")
    hash_ids = _check_hash_ids(raw, line, where)
    expected = _num_blocks(raw["input_length"], block_size)
    if len(hash_ids) != expected:
        fits = [b for b in _BLOCK_SIZES if _num_blocks(raw["input_length"], b) == len(hash_ids)]
        hint = (
            f" (the trace's block size looks like {fits[0]}: --block-size {fits[0]})"
            if fits
            else ""
        )
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length={raw['input_length']}, "
            f"expected {expected} at block size {block_size}{hint}"
        )
    return TraceRecord(raw["timestamp"], raw["input_length"], raw["output_length"], hash_ids)


class _RepeatedFieldError(Exception):
    """A JSON object names a field twice (json.loads would keep the last value)."""


def _unique_fields(pairs: list[tuple[str, object]]) -> dict[str, object]:
    fields = dict(pairs)
    if len(fields) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _RepeatedFieldError(name)
            seen.add(name)
    return fields


def _num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # exact, where float division is not


# Block sizes a trace's hash ids are likely to be of, tried for an error's hint.
_BLOCK_SIZES = tuple(2**i for i in range(14))


def _check_hash_ids(raw: dict[str, object], line: str, where: str) -> tuple[int, ...]:
    """Return the `hash_ids` of `raw` (read from `line`) as a tuple: distinct ints in
    [0, 2**64) (the replay's 8-byte keys)."""
    hash_ids = raw["hash_ids"]
    if not isinstance(hash_ids, list):
        written = value_as_written(line, raw, "hash_ids")
        raise TraceError(f"{where}: hash_ids must be a list of ints >= 0, got {written}")
    for j, h in enumerate(hash_ids):
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            written = value_as_written(line, raw, "hash_ids", j)
            raise TraceError(f"{where}: hash_ids[{j}] must be an int >= 0, got {written}")
    too_large = next((h for h in hash_ids if h >= MAX_HASH_ID), None)
    if too_large is not None:
        raise TraceError(f"{where}: hash id {too_large} does not fit in 64 bits (must be < 2**64)")
    check_distinct_ids(hash_ids, where)
    return tuple(hash_ids)


def check_distinct_ids(hash_ids: Sequence[int], where: str) -> None:
    """Raise `TraceError` naming `where` if an id repeats in one record's `hash_ids`.

    Ids are chained prefix hashes: the prefix up to a later block is a longer one, so a
    repeat is a malformed record, never a legitimate one (replayed, it would be stored
    once per repeat and hit where no prefix matched)."""
    if len(set(hash_ids)) == len(hash_ids):
        return
    first: dict[int, int] = {}
    for j, h in enumerate(hash_ids):
        if h in first:
            raise TraceError(
                f"{where}: hash id {h} repeats within the record (positions {first[h]} "
                f"and {j}); chained prefix hashes cannot repeat in one prompt"
            )
        first[h] = j


def read_trace(path: str | Path, block_size: int = DEFAULT_BLOCK_SIZE) -> list[TraceRecord]:
    """Read and validate a whole trace; blank lines are skipped.

    Raises `TraceError` naming `path:line` for the first malformed record, when
    timestamps go backwards, and when a hash id follows another id than where it was
    first seen (ids that are not chained prefix hashes would replay as false prefix
    hits). A gzip-compressed file is read as its decompressed text; a UTF-8 byte order
    mark before the first record is skipped.
    """
    return [record for _, record in read_numbered_trace(path, block_size)]


def read_numbered_trace(
    path: str | Path, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[tuple[int, TraceRecord]]:
    """Return `(line number, record)` for every record of the trace, as `read_trace` reads."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    records: list[tuple[int, TraceRecord]] = []
    last_timestamp = 0
    parents: dict[int, object] = {}  # check_chain's: what each id seen so far follows
    with _open_binary(path) as file:
        for number, data in _numbered_lines(file, path):
            where = f"{path}:{number}"
            try:
                line = data.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(
                    f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column "
                    f"{exc.start + 1}); a binary or compressed file? (gzip is read as is)"
                ) from None
            if not line.strip():
                continue
            record = parse_record(line, block_size, where)
            if record.timestamp_ms < last_timestamp:
                raise TraceError(
                    f"{where}: timestamp {record.timestamp_ms} is before the previous "
                    f"record's {last_timestamp}"
                )
            last_timestamp = record.timestamp_ms
            check_chain(record, block_size, parents, records, where)
            records.append((number, record))
    if not records:
        raise TraceError(f"{path}: no records")
    return records


def check_chain(
    record: TraceRecord,
    block_size: int,
    parents: dict[int, object],
    earlier: Iterable[tuple[int, TraceRecord]],
    where: str,
    unit: str = "line",
) -> None:
    """Raise `TraceError` naming `where` unless `record`'s ids are chained prefix hashes:
    distinct (`check_distinct_ids`), each following the id it followed where first seen
    and covering as many tokens (a partial last block is another prefix than a full one).
    Shared by `read_trace` and `trace_keys`: replayed, a broken chain is a false prefix hit.

    `parents` holds what the ids seen so far followed (-1: the start of a prompt; with
    the tokens of a block shorter than `block_size`); `record`'s new ids are added.
    `earlier`, the records before as `(number, record)` (each `number` a `unit`: a line,
    or a record's index), is read only to name where an id was first seen."""
    ids = record.hash_ids
    check_distinct_ids(ids, where)
    full = max(0, min(len(ids), record.input_length // block_size))  # of block_size tokens
    claim = parents.setdefault
    parent = -1  # before the first block (ids are >= 0)
    for hash_id in ids[:full]:
        if claim(hash_id, parent) != parent:
            raise _chain_error(record, ids.index(hash_id), block_size, earlier, where, unit)
        parent = hash_id
    for position in range(full, len(ids)):  # partial: another prefix than a full block's
        expected = (parent, record.block_tokens(position, block_size))
        if claim(ids[position], expected) != expected:
            raise _chain_error(record, position, block_size, earlier, where, unit)
        parent = ids[position]


def _chain_error(
    record: TraceRecord,
    position: int,
    block_size: int,
    earlier: Iterable[tuple[int, TraceRecord]],
    where: str,
    unit: str,
) -> TraceError:
    """Return the error for `record.hash_ids[position]`, an id first seen in `earlier`
    after another id, or covering other tokens."""
    hash_id = record.hash_ids[position]
    parent = record.hash_ids[position - 1] if position else -1
    tokens = record.block_tokens(position, block_size)
    found = next(((n, r) for n, r in earlier if hash_id in r.hash_ids), None)
    assert found is not None, f"hash id {hash_id} is not in the records before {where}"
    number, first = found
    j = first.hash_ids.index(hash_id)
    seen_parent = first.hash_ids[j - 1] if j else -1
    seen_tokens = first.block_tokens(j, block_size)
    if seen_parent != parent:
        return TraceError(
            f"{where}: hash_ids[{position}] = {hash_id} {_after(parent)}, but it "
            f"{_after(seen_parent)} at {unit} {number}; hash ids must be chained prefix "
            "hashes (equal ids, equal prefixes)"
        )
    return TraceError(
        f"{where}: hash_ids[{position}] = {hash_id} covers {tokens} tokens, but "
        f"{seen_tokens} at {unit} {number}; a partial last block needs an id of its own "
        "(equal ids, equal prefixes)"
    )


def _after(parent: int) -> str:
    return "starts the prompt" if parent < 0 else f"follows id {parent}"


@contextmanager
def _open_binary(path: str | Path) -> Iterator[BinaryIO | gzip.GzipFile]:
    """Open `path` for reading bytes, decompressing it if it starts with gzip's magic.

    The file is opened once and its first bytes are peeked, not read: a pipe
    (`<(zcat t.jsonl.gz)`, /dev/stdin) cannot be read a second time.
    """
    with open(path, "rb") as file:
        if file.peek(len(_GZIP_MAGIC))[: len(_GZIP_MAGIC)] == _GZIP_MAGIC:
            with gzip.GzipFile(fileobj=file, mode="rb") as unpacked:
                yield unpacked
        else:
            yield file


def _numbered_lines(
    file: BinaryIO | gzip.GzipFile, path: str | Path
) -> Iterator[tuple[int, bytes]]:
    """Yield `(line number, line)`; a corrupt gzip stream, or a line longer than
    MAX_LINE_BYTES, is a `TraceError` naming `path` and the line."""
    number = 0
    try:
        while data := file.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(data) > MAX_LINE_BYTES:
                raise TraceError(
                    f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes; not a "
                    "JSON-lines trace?"
                )
            yield number, data
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise TraceError(f"{path}:{number + 1}: corrupt gzip data ({exc})") from None


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    """Write records as Mooncake-format JSON lines (all of them, or `path` is untouched),
    gzip-compressed when `path` ends in `.gz`."""
    lines = (
        json.dumps(
            {
                "timestamp": record.timestamp_ms,
                "input_length": record.input_length,
                "output_length": record.output_length,
                "hash_ids": list(record.hash_ids),
            }
        )
        + "\n"
        for record in records
    )
    if not str(path).endswith(".gz"):
        with whole_file(path) as file:
            file.writelines(lines)
        return
    with (
        whole_file(path, binary=True) as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed,
    ):
        for line in lines:
            packed.write(line.encode())


@dataclass(frozen=True)
class TraceSummary:
    """Size of a trace and its hit ratio with an infinite cache (prefix hits only)."""

    num_requests: int
    num_block_refs: int
    num_distinct_blocks: int
    num_prompt_tokens: int
    infinite_token_hit_ratio: float
    duration_s: float


def summarize(records: Sequence[TraceRecord], block_size: int) -> TraceSummary:
    """Return the trace's size and its infinite-cache token hit ratio."""
    seen: set[int] = set()
    hit_tokens = 0
    for record in records:
        ids = record.hash_ids
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hit_tokens += min(n * block_size, record.input_length)
        seen.update(ids)
    total = sum(r.input_length for r in records)
    return TraceSummary(
        num_requests=len(records),
        num_block_refs=sum(len(r.hash_ids) for r in records),
        num_distinct_blocks=len(seen),
        num_prompt_tokens=total,
        infinite_token_hit_ratio=hit_tokens / total if total else 0.0,
        duration_s=(records[-1].timestamp_ms - records[0].timestamp_ms) / 1000,
    )
