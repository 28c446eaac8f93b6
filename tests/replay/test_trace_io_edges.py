"""Trace reading and writing, and the record checks, at the edges the first mutation run
on trace.py / trace_checks.py found untested: a missing `hash_ids`, timestamps compared
only with the first record's, an id's first sighting, the block-size hint for blocks of
one token, a record's field order and a gzip trace's header."""

from __future__ import annotations

import gzip
import json
import os
import threading
from pathlib import Path

import pytest

from kvtier.replay import trace
from kvtier.replay.trace import TraceError, TraceRecord, read_trace, summarize, write_trace
from kvtier.replay.trace_checks import check_records

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}


def write_lines(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_record_without_hash_ids_names_the_missing_field(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{k: v for k, v in GOOD.items() if k != "hash_ids"}])
    with pytest.raises(TraceError, match=r"t.jsonl:1: missing field\(s\) hash_ids$"):
        read_trace(path)


def test_a_timestamp_before_the_previous_one_names_both_lines(tmp_path: Path) -> None:
    """Each record is compared with the one before it, not with the first: 0, 10, 5 is
    out of order at line 3 (after line 2's 10), though 5 is after line 1's 0."""
    rows = [{**GOOD, "timestamp": t, "hash_ids": [1, 2]} for t in (0, 10, 5)]
    path = write_lines(tmp_path / "t.jsonl", rows)
    with pytest.raises(TraceError, match=r"t.jsonl:3: timestamp 5 is before the previous "):
        read_trace(path)
    with pytest.raises(TraceError, match=r"record 2: timestamp 5 .* record's 10 \(record 1\)"):
        check_records([TraceRecord(t, 1000, 5, (1, 2)) for t in (0, 10, 5)], 512)


def test_a_broken_chain_names_the_line_where_the_id_was_first_seen(tmp_path: Path) -> None:
    """Id 2 follows id 1 at lines 1 and 2; line 3 puts it after id 9: the message names
    line 1, where the id was first seen (`check_chain`'s contract), not line 2."""
    rows = [GOOD, {**GOOD, "timestamp": 1}, {**GOOD, "timestamp": 2, "hash_ids": [9, 2]}]
    path = write_lines(tmp_path / "t.jsonl", rows)
    message = r"t.jsonl:3: hash_ids\[1\] = 2 follows id 9, but it follows id 1 at line 1;"
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_ids_of_one_token_blocks_get_the_block_size_1_hint() -> None:
    """A trace of 1-token blocks (one id per token) read at 512: the hint names 1."""
    record = TraceRecord(0, 5, 1, (1, 2, 3, 4, 5))
    with pytest.raises(TraceError, match=r"looks like 1: --block-size 1\)$"):
        check_records([record], 512)


@pytest.mark.parametrize(
    ("field", "value"),
    [("output_length", 1.5), ("hash_ids", (True, 2))],
)
def test_the_api_refuses_a_record_of_other_types(field: str, value: object) -> None:
    """Records handed to the API are type-checked as a file's are: a float output_length
    and a bool hash id are refused, naming the record (`check_record_types`)."""
    values: dict[str, object] = {
        "timestamp_ms": 0,
        "input_length": 1000,
        "output_length": 5,
        "hash_ids": (1, 2),
    }
    values[field] = value
    record = TraceRecord(**values)  # type: ignore[arg-type]
    with pytest.raises(TraceError, match=r"^record 0: (output_length|hash_ids\[0\]) must be an"):
        check_records([record], 512)


def test_an_empty_trace_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(TraceError, match=r"t.jsonl: no records$"):
        read_trace(path)


def test_a_written_record_keeps_the_mooncake_field_order(tmp_path: Path) -> None:
    """Written lines read like the Mooncake trace's: timestamp, input_length,
    output_length, hash_ids."""
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRecord(3, 1000, 5, (1, 2))])
    assert path.read_text() == (
        '{"timestamp": 3, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}\n'
    )


def test_a_gzip_trace_has_no_time_in_its_header(tmp_path: Path) -> None:
    """The gzip header's mtime is 0: one seed's trace is the same bytes whenever written."""
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, [TraceRecord(3, 1000, 5, (1, 2))])
    data = path.read_bytes()
    assert int.from_bytes(data[4:8], "little") == 0
    assert gzip.decompress(data).startswith(b'{"timestamp": 3,')


def test_a_gzip_trace_write_that_fails_part_way_leaves_the_old_trace(tmp_path: Path) -> None:
    """As for a plain trace: a failed write leaves the old file and no temporary one."""
    path = tmp_path / "t.jsonl.gz"
    records = [TraceRecord(t, 1000, 5, (1, 2)) for t in range(3)]
    write_trace(path, records)

    def failing() -> object:
        yield records[0]
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_trace(path, failing())  # type: ignore[arg-type]
    assert read_trace(path) == records
    assert os.listdir(tmp_path) == ["t.jsonl.gz"]


def test_the_duration_runs_from_the_first_request() -> None:
    records = [TraceRecord(5_000, 10, 1, (1,)), TraceRecord(7_500, 10, 1, (1,))]
    assert summarize(records, 512).duration_s == 2.5


def test_a_line_without_end_is_refused_without_waiting_for_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading stops at MAX_LINE_BYTES: from a pipe that never sends a newline (nor ends)
    the error comes at once, not when the writer gives up (`kvtier replay /dev/zero`)."""
    monkeypatch.setattr(trace, "MAX_LINE_BYTES", 1000)
    read_end, write_end = os.pipe()
    answered = threading.Event()
    gave_up: list[bool] = []

    def writer() -> None:
        os.write(write_end, b"x" * 4000)
        gave_up.append(not answered.wait(timeout=10))
        os.close(write_end)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        with pytest.raises(TraceError, match="line longer than 1000 bytes"):
            read_trace(f"/dev/fd/{read_end}")
    finally:
        answered.set()
        thread.join()
        os.close(read_end)
    assert gave_up == [False]
