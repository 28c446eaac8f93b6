"""The checks every replayed trace passes, made once, the same way, whichever way it came:
read from a file (`trace.read_trace`, errors name `path:line`) or handed to the API as
`TraceRecord`s (`check_records`, by `trace_keys`; errors name `record <index>`).

`TraceChecker` holds what spans records: timestamps in non-decreasing order, and the
chain of hash ids (an id always follows the id it first followed). Per record it checks
the values: the three counts are >= 0, each hash id is in [0, 2**64) (the replay's keys
are its 8 bytes), and `input_length` takes exactly one id per `block_size`-token block.
The types are checked before it: by the JSON reader (values as written in the file), or
by `check_record_types` for records built in Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.core.plural import counted
from kvtier.replay.trace_record import TraceError, TraceRecord

MAX_HASH_ID = 1 << 64  # ids become 8-byte little-endian keys
# Block sizes a trace's hash ids are likely to be of, tried for an error's hint.
_BLOCK_SIZES = tuple(2**i for i in range(14))


class TraceChecker:
    """Check records one after another, in trace order (`add`); each only once."""

    def __init__(self, block_size: int, unit: str) -> None:
        """`unit` names what a record's number counts in errors: "line" or "record"."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
        self.block_size = block_size
        self.unit = unit
        self._parents: dict[int, object] = {}  # check_chain's: every id seen so far
        self._checked: list[tuple[int, TraceRecord]] = []
        self._last: tuple[int, int] | None = None  # (number, timestamp) of the last record

    def add(self, number: int, record: TraceRecord, where: str) -> None:
        """Check `record` (its number `number`, named `where` in errors) after those added."""
        check_values(record, self.block_size, where)
        if self._last is not None and record.timestamp_ms < self._last[1]:
            number_before, timestamp_before = self._last
            raise TraceError(
                f"{where}: timestamp {record.timestamp_ms} is before the previous "
                f"record's {timestamp_before} ({self.unit} {number_before}); records "
                "must be in arrival order"
            )
        check_chain(record, self.block_size, self._parents, self._checked, where, self.unit)
        self._last = (number, record.timestamp_ms)
        self._checked.append((number, record))


def check_records(records: Sequence[TraceRecord], block_size: int) -> None:
    """Check records handed to the API as `read_trace` checks a file's (`TraceChecker`,
    after `check_record_types`).

    Raises `TraceError` naming `record <index>` and the bad value; ValueError for a
    `block_size` that is not an int > 0."""
    checker = TraceChecker(block_size, "record")
    for index, record in enumerate(records):
        where = f"record {index}"
        check_record_types(record, where)
        checker.add(index, record, where)


def check_record_types(record: object, where: str) -> None:
    """Raise `TraceError` naming `where` unless `record` is a `TraceRecord` of ints (its
    `hash_ids` a tuple or list of ints); bools are refused, as in a file."""
    if not isinstance(record, TraceRecord):
        raise TraceError(f"{where}: expected a TraceRecord, got {record!r}")
    for name in ("timestamp_ms", "input_length", "output_length"):
        value = getattr(record, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TraceError(f"{where}: {name} must be an int >= 0, got {value!r}")
    if not isinstance(record.hash_ids, (tuple, list)):
        raise TraceError(f"{where}: hash_ids must be a tuple of ints >= 0, got {record.hash_ids!r}")
    for j, h in enumerate(record.hash_ids):
        if not isinstance(h, int) or isinstance(h, bool):
            raise TraceError(f"{where}: hash_ids[{j}] must be an int >= 0, got {h!r}")


def check_values(record: TraceRecord, block_size: int, where: str) -> None:
    """Raise `TraceError` naming `where` and the value unless `record`'s counts are >= 0,
    its ids in [0, 2**64) and one per `block_size`-token block of `input_length`."""
    fields = (
        ("timestamp", record.timestamp_ms),
        ("input_length", record.input_length),
        ("output_length", record.output_length),
    )
    for name, value in fields:
        if value < 0:
            raise TraceError(f"{where}: {name} must be an int >= 0, got {value}")
    ids = record.hash_ids
    if ids and (min(ids) < 0 or max(ids) >= MAX_HASH_ID):
        j, h = next((j, h) for j, h in enumerate(ids) if not 0 <= h < MAX_HASH_ID)
        if h < 0:
            raise TraceError(f"{where}: hash_ids[{j}] must be an int >= 0, got {h}")
        raise TraceError(
            f"{where}: hash_ids[{j}]: hash id {h} does not fit in 64 bits (must be < 2**64)"
        )
    expected = num_blocks(record.input_length, block_size)
    if len(ids) != expected:
        fits = [b for b in _BLOCK_SIZES if num_blocks(record.input_length, b) == len(ids)]
        hint = ""
        if fits:
            hint = f" (the trace's block size looks like {fits[0]}: --block-size {fits[0]})"
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length={record.input_length}, "
            f"expected {expected} at block size {block_size}{hint}"
        )


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Return the blocks of `block_size` tokens that `num_tokens` tokens take."""
    return -(-num_tokens // block_size)  # exact, where float division is not


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
    Replayed, a broken chain is a false prefix hit.

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
        f"{where}: hash_ids[{position}] = {hash_id} covers {counted(tokens, 'token')}, but "
        f"{seen_tokens} at {unit} {number}; a partial last block needs an id of its own "
        "(equal ids, equal prefixes)"
    )


def _after(parent: int) -> str:
    return "starts the prompt" if parent < 0 else f"follows id {parent}"
