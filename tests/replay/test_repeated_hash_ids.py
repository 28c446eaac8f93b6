"""A record whose hash ids repeat (`[1, 2, 1]`) is malformed: ids are chained prefix
hashes, and the prefix up to a later block is a longer one. `kvtier replay` and the
Python API both reject it with the same message, naming the line or the record."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from replay_helpers import BLOCK

from kvtier.replay import ReplayConfig, TierConfig, TierReplay, TraceError, replay_trace
from kvtier.replay.cli import main
from kvtier.replay.sweep import run_sweep
from kvtier.replay.tier_replay import trace_keys
from kvtier.replay.trace import TraceRecord

REPEAT = "hash id 1 repeats within the record (positions 0 and 2)"
RECORDS = [TraceRecord(0, 2 * BLOCK, 1, (7, 8)), TraceRecord(1, 3 * BLOCK, 1, (1, 2, 1))]
CONFIG = ReplayConfig(tiers=(TierConfig("CPU", 10 * BLOCK, 25.0),), block_size=BLOCK)


def test_the_cli_rejects_it_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": r.timestamp_ms, "input_length": r.input_length, "output_length": 1}
        | {"hash_ids": list(r.hash_ids)}
        for r in RECORDS
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main([str(path), "--block-size", str(BLOCK), "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"t.jsonl:2: {REPEAT}" in err


def _sweep(records: Sequence[TraceRecord]) -> object:
    return run_sweep(records, CONFIG, ["lru"], [10 * BLOCK])


@pytest.mark.parametrize(
    "entry",
    [
        lambda records: replay_trace(records, CONFIG),
        lambda records: TierReplay(records, CONFIG),
        _sweep,
        lambda records: trace_keys(records, BLOCK),
    ],
    ids=["replay_trace", "TierReplay", "run_sweep", "trace_keys"],
)
def test_the_api_rejects_it_naming_the_record(
    entry: Callable[[Sequence[TraceRecord]], object],
) -> None:
    """Regression: the API replayed it, storing the repeated id once per repeat."""
    entry(RECORDS[:1])  # the good record alone replays
    with pytest.raises(TraceError, match="^" + re.escape(f"record 1: {REPEAT}")):
        entry(RECORDS)
