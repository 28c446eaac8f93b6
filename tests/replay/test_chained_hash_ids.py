"""Hash ids are chained prefix hashes: an id always follows the id it first followed (or
always starts a prompt), and a partial last block's id is never a block of other length.
`kvtier replay` (`read_trace`) and the Python API (`trace_keys`, so `replay_trace`,
`TierReplay`, `run_sweep`) reject a record that breaks either rule with one message,
naming the line or the record's index, and the ids (`trace_checks.check_chain`, shared)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from replay_helpers import API_CONFIG, API_ENTRIES, BLOCK

from kvtier.replay import TraceError, replay_trace
from kvtier.replay.tier_replay import trace_keys
from kvtier.replay.trace import TraceRecord, read_trace

GOOD = TraceRecord(0, 2 * BLOCK, 1, (1, 2))
CHAINED = "; hash ids must be chained prefix hashes (equal ids, equal prefixes)"
OWN_ID = "; a partial last block needs an id of its own (equal ids, equal prefixes)"

# (the records after GOOD, the index of the record that saw the id first, the error for
# the last record: `where` names it, `first` the record or line that saw the id first)
CASES = {
    "another parent": (
        [TraceRecord(1, 2 * BLOCK, 1, (3, 2))],
        0,
        "{where}: hash_ids[1] = 2 follows id 3, but it follows id 1 at {first}" + CHAINED,
    ),
    "a start, then a parent": (
        [TraceRecord(1, 2 * BLOCK, 1, (2, 5))],
        0,
        "{where}: hash_ids[0] = 2 starts the prompt, but it follows id 1 at {first}" + CHAINED,
    ),
    "a parent, then a start": (
        [TraceRecord(1, 2 * BLOCK, 1, (0, 1))],
        0,
        "{where}: hash_ids[1] = 1 follows id 0, but it starts the prompt at {first}" + CHAINED,
    ),
    "a full block's id partial": (
        [TraceRecord(1, BLOCK + 3, 1, (1, 2))],
        0,
        f"{{where}}: hash_ids[1] = 2 covers 3 tokens, but {BLOCK} at {{first}}" + OWN_ID,
    ),
    "a partial block's id full": (
        [TraceRecord(1, BLOCK + 3, 1, (1, 4)), TraceRecord(2, 3 * BLOCK, 1, (1, 4, 5))],
        1,
        f"{{where}}: hash_ids[1] = 4 covers {BLOCK} tokens, but 3 at {{first}}" + OWN_ID,
    ),
    "a partial block's id of other length": (
        [TraceRecord(1, BLOCK + 3, 1, (1, 4)), TraceRecord(2, BLOCK + 5, 1, (1, 4))],
        1,
        "{where}: hash_ids[1] = 4 covers 5 tokens, but 3 at {first}" + OWN_ID,
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("entry", API_ENTRIES)
def test_the_api_rejects_a_broken_chain_naming_the_record_and_ids(entry: str, case: str) -> None:
    """Regression: the API replayed such records (the CLI refused them), a reused id
    serving a prefix hit where the prompts differ."""
    after, first, template = CASES[case]
    records = [GOOD, *after]
    API_ENTRIES[entry](records[:-1])  # the records before the last replay
    message = template.format(where=f"record {len(after)}", first=f"record {first}")
    with pytest.raises(TraceError, match="^" + re.escape(message) + "$"):
        API_ENTRIES[entry](records)


@pytest.mark.parametrize("case", CASES)
def test_the_cli_reader_gives_the_same_message_naming_lines(tmp_path: Path, case: str) -> None:
    after, first, template = CASES[case]
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": r.timestamp_ms, "input_length": r.input_length, "output_length": 1}
        | {"hash_ids": list(r.hash_ids)}
        for r in [GOOD, *after]
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    message = template.format(where=f"{path}:{len(lines)}", first=f"line {first + 1}")
    with pytest.raises(TraceError, match="^" + re.escape(message) + "$"):
        read_trace(path, BLOCK)


def test_chained_records_replay_alike_through_the_api_and_the_reader(tmp_path: Path) -> None:
    """A shared prefix, a partial block with an id of its own, an id repeated at its
    place: accepted by both, with the keys' prefix hits."""
    records = [
        GOOD,
        TraceRecord(1, 2 * BLOCK + 3, 1, (1, 2, 6)),
        TraceRecord(2, BLOCK + 3, 1, (1, 7)),
        TraceRecord(3, 3 * BLOCK, 1, (1, 2, 8)),
    ]
    keys = trace_keys(records, BLOCK)
    assert keys[0] == keys[1][:2] == keys[3][:2]
    assert replay_trace(records, API_CONFIG).tiers[0].num_hit_blocks == 2 + 1 + 2
