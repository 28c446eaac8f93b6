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

from kvtier.replay.trace_checks import TraceChecker
from kvtier.replay.trace_record import TraceError, TraceRecord
from kvtier.replay.trace_values import value_as_written
from kvtier.replay.whole_file import whole_file

DEFAULT_BLOCK_SIZE = 512
# The largest block size a trace may be read (`kvtier replay --block-size`) or written
# (`generate --block-size`) at, in tokens: longer than any prompt the generator's
# defaults make and 2048 times the Mooncake trace's 512. Larger ones are a typo: every
# prompt is then one block, and the mismatch was only found after reading the trace.
MAX_BLOCK_SIZE = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
# A record's line is at most this long: 2^20 tokens in blocks of 16 take ~1.3 MB of ids.
# Reading stops there, so an input with no newline (/dev/zero) ends with an error.
MAX_LINE_BYTES = 64 << 20
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def parse_record(line: str, where: str) -> TraceRecord:
    """Parse one JSON line into a record of ints; raise `TraceError` naming `where` and the
    value as written in the line where it is not JSON, or not a record of ints. The
    values are checked by `TraceChecker`, as the API's records are."""
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
        if not isinstance(value, int) or isinstance(value, bool):
            written = value_as_written(line, raw, name)
            raise TraceError(f"{where}: {name} must be an int >= 0, got {written}")
    hash_ids = raw["hash_ids"]
    if not isinstance(hash_ids, list):
        written = value_as_written(line, raw, "hash_ids")
        raise TraceError(f"{where}: hash_ids must be a list of ints >= 0, got {written}")
    for j, h in enumerate(hash_ids):
        if not isinstance(h, int) or isinstance(h, bool):
            written = value_as_written(line, raw, "hash_ids", j)
            raise TraceError(f"{where}: hash_ids[{j}] must be an int >= 0, got {written}")
    return TraceRecord(raw["timestamp"], raw["input_length"], raw["output_length"], tuple(hash_ids))


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


def read_trace(path: str | Path, block_size: int = DEFAULT_BLOCK_SIZE) -> list[TraceRecord]:
    """Read and check a whole trace; blank lines are skipped.

    Raises `TraceError` naming `path:line` and the value for the first malformed record
    (`parse_record`, then `TraceChecker`'s checks, which records handed to the API pass
    too): a value of the wrong type or < 0, a hash id outside [0, 2**64), hash ids that do
    not match `input_length` at `block_size`, a timestamp before the previous record's, or
    hash ids that are not chained prefix hashes (they would replay as false prefix
    hits). ValueError for a `block_size` that is not an int > 0. A gzip-compressed file
    is read as its decompressed text; a UTF-8 byte order mark before the first record is
    skipped.
    """
    return [record for _, record in read_numbered_trace(path, block_size)]


def read_numbered_trace(
    path: str | Path, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[tuple[int, TraceRecord]]:
    """Return `(line number, record)` for every record of the trace, as `read_trace` reads."""
    checker = TraceChecker(block_size, "line")
    records: list[tuple[int, TraceRecord]] = []
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
            record = parse_record(line, where)
            checker.add(number, record, where)
            records.append((number, record))
    if not records:
        raise TraceError(f"{path}: no records")
    return records


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
    gzip-compressed when `path` ends in `.gz` (any case: `T.JSONL.GZ` too)."""
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
    if not str(path).lower().endswith(".gz"):
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
