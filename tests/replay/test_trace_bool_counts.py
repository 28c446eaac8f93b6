"""A JSON `true` is no count: `read_trace` refuses it in every count field, naming the
line (found by a mutation run: accepting a bool there passed every other test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.replay.trace import TraceError, read_trace

GOOD = {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [7]}


@pytest.mark.parametrize("field", ["timestamp", "input_length", "output_length"])
def test_a_bool_count_is_refused_naming_the_line(tmp_path: Path, field: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, field: True}) + "\n")
    with pytest.raises(TraceError, match=rf":2: {field} must be an int >= 0, got true"):
        read_trace(path, block_size=4)
