"""Records handed to the Python API (`trace_keys`, so `replay_trace`, `TierReplay` and
`run_sweep`) are checked as `kvtier replay` checks a file's (`trace_checks.TraceChecker`):
timestamps in arrival order, hash ids in [0, 2**64) and one per block of `input_length`,
ints throughout; the error names the record's index and the bad value. `kvtier replay`
checks its trace once.

Regression: the API checked only the chain of ids. Timestamps going backwards and hash
ids that did not match `input_length` were replayed (hit tokens counted from a wrong
block count); an id outside 64 bits failed with OverflowError naming nothing.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import FrameType

import pytest
from replay_helpers import API_ENTRIES, BLOCK, chat_trace

from kvtier.replay import TraceError
from kvtier.replay.cli import main
from kvtier.replay.tier_replay import trace_keys
from kvtier.replay.trace import TraceRecord, read_trace, write_trace

GOOD = TraceRecord(10, 2 * BLOCK, 1, (1, 2))


# (the record after GOOD, the error naming it: record 1)
CASES: dict[str, tuple[object, str]] = {
    "timestamp backwards": (
        TraceRecord(9, BLOCK, 1, (1,)),
        "timestamp 9 is before the previous record's 10 (record 0); records must be in "
        "arrival order",
    ),
    "too many ids": (
        TraceRecord(10, BLOCK + 1, 1, (1, 2, 3)),
        f"3 hash_ids for input_length={BLOCK + 1}, expected 2 at block size {BLOCK} (the "
        "trace's block size looks like 4: --block-size 4)",
    ),
    "too few ids": (
        TraceRecord(10, 3 * BLOCK, 1, (1, 2)),
        f"2 hash_ids for input_length={3 * BLOCK}, expected 3 at block size {BLOCK} (the "
        "trace's block size looks like 16: --block-size 16)",
    ),
    "one id, many sizes fit": (  # the smallest is named (a mutant naming the largest passed)
        TraceRecord(10, 3 * BLOCK, 1, (1,)),
        f"1 hash_ids for input_length={3 * BLOCK}, expected 3 at block size {BLOCK} (the "
        "trace's block size looks like 32: --block-size 32)",
    ),
    "ids for no tokens": (
        TraceRecord(10, 0, 1, (5,)),
        f"1 hash_ids for input_length=0, expected 0 at block size {BLOCK}",
    ),
    "id of 65 bits": (
        TraceRecord(10, 2 * BLOCK, 1, (1, 2**64)),
        f"hash_ids[1]: hash id {2**64} does not fit in 64 bits (must be < 2**64)",
    ),
    "negative id": (TraceRecord(10, BLOCK, 1, (-4,)), r"hash_ids[0] must be an int >= 0, got -4"),
    "negative count": (
        TraceRecord(10, BLOCK, -1, (1,)),
        "output_length must be an int >= 0, got -1",
    ),
    "float timestamp": (
        TraceRecord(10.5, BLOCK, 1, (1,)),  # type: ignore[arg-type]
        "timestamp_ms must be an int >= 0, got 10.5",
    ),
    "bool length": (
        TraceRecord(10, True, 1, (1,)),
        "input_length must be an int >= 0, got True",
    ),
    "str id": (TraceRecord(10, BLOCK, 1, ("1",)), "hash_ids[0] must be an int >= 0, got '1'"),  # type: ignore[arg-type]
    "ids not a sequence": (
        TraceRecord(10, BLOCK, 1, 7),  # type: ignore[arg-type]
        "hash_ids must be a tuple of ints >= 0, got 7",
    ),
    "not a record": ({"timestamp": 10}, "expected a TraceRecord, got {'timestamp': 10}"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("entry", API_ENTRIES)
def test_the_api_rejects_a_bad_record_naming_its_index_and_value(entry: str, case: str) -> None:
    bad, message = CASES[case]
    API_ENTRIES[entry]([GOOD])  # the good record alone replays
    with pytest.raises(TraceError, match=f"^record 1: {re.escape(message)}$"):
        API_ENTRIES[entry]([GOOD, bad])  # type: ignore[list-item]


def test_equal_timestamps_partial_blocks_and_the_largest_id_replay() -> None:
    """What the Mooncake trace holds passes: equal timestamps (11 pairs there), a last
    block of one token, a prompt of whole blocks; and the largest 64-bit id."""
    records = [
        TraceRecord(0, 2 * BLOCK + 1, 1, (0, 1, 2)),
        TraceRecord(0, 2 * BLOCK, 4, (0, 1)),
        TraceRecord(7, BLOCK, 0, (2**64 - 1,)),
    ]
    for entry in API_ENTRIES.values():
        entry(records)


def test_a_block_size_that_is_not_a_positive_int_is_refused() -> None:
    for block_size in (0, -8, 8.0, True):
        with pytest.raises(ValueError, match=f"block_size must be an int > 0, got {block_size}"):
            trace_keys([GOOD], block_size)  # type: ignore[arg-type]


def test_the_file_and_the_api_give_the_same_message(tmp_path: Path) -> None:
    for case in ("timestamp backwards", "too many ids", "id of 65 bits", "negative id"):
        bad, message = CASES[case]
        assert isinstance(bad, TraceRecord)
        path = tmp_path / "t.jsonl"
        write_trace(path, [GOOD, bad])
        expected = message.replace("(record 0)", "(line 1)")
        with pytest.raises(TraceError, match=f"^{re.escape(f'{path}:2: {expected}')}$"):
            read_trace(path, BLOCK)


def test_kvtier_replay_checks_each_record_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: read_trace checked the chain of ids, then run_sweep's `trace_keys`
    checked it again (~25 ms of the Mooncake trace's start)."""
    records = chat_trace(conversations=5)
    path = tmp_path / "t.jsonl"
    write_trace(path, records)
    calls = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call" and frame.f_code.co_name == "check_chain"

    sys.setprofile(count)
    try:
        status = main([str(path), "--block-size", str(BLOCK), "--capacity", "64", "--quiet"])
    finally:
        sys.setprofile(None)
    assert status == 0, capsys.readouterr().err
    assert calls == len(records)


def test_the_cli_names_the_line_of_a_backwards_timestamp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": t, "input_length": 4, "output_length": 1, "hash_ids": [t]} for t in (5, 3)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main([str(path), "--block-size", str(BLOCK), "--quiet"]) == 2
    assert "t.jsonl:2: timestamp 3 is before the previous record's 5 (line 1)" in (
        capsys.readouterr().err
    )
