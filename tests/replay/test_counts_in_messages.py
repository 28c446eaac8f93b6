"""A count of one is singular in what `kvtier replay` and `kvtier generate` print:
"1 request", not "1 requests" (found by a fresh-user walkthrough of "(1 usable blocks)"
in the demo; these are the same messages built from counts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.replay.config import ReplayConfig, ReplayError, TierConfig
from kvtier.replay.trace import TraceError, read_trace

ONE_BLOCK = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7]}\n'


def test_replay_summarizes_a_one_request_trace_in_the_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "one.jsonl"
    trace.write_text(ONE_BLOCK)
    assert main(["replay", str(trace), "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"{trace}: 1 request, 1 block ref, 1 distinct block, infinite")


def test_a_one_token_id_reused_is_told_in_the_singular(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        ONE_BLOCK + '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [7]}\n'
    )
    with pytest.raises(TraceError, match=r"hash_ids\[0\] = 7 covers 1 token, but 512 at line"):
        read_trace(trace, 512)


def test_generate_reports_one_request_in_the_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seed 4 makes one conversation of a single turn."""
    out = tmp_path / "one.jsonl"
    assert main(["generate", str(out), "--conversations", "1", "--seed", "4"]) == 0
    assert len(read_trace(out)) == 1
    assert capsys.readouterr().out == f"wrote 1 request to {out}\n"


def test_a_one_token_capacity_is_told_in_the_singular() -> None:
    """The library said "capacity 1 tokens holds no 2-token block"."""
    with pytest.raises(ReplayError, match=r"^tier CPU: capacity 1 token holds no 2-token block$"):
        ReplayConfig(tiers=(TierConfig("CPU", 1, 25.0),), block_size=2)


def test_a_one_token_block_is_asked_for_in_the_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--capacity 0 --block-size 1` said "give at least 1 tokens"."""
    trace = tmp_path / "one.jsonl"
    trace.write_text(ONE_BLOCK)
    assert main(["replay", str(trace), "--capacity", "0", "--block-size", "1"]) == 2
    assert "(--block-size 1): give at least 1 token\n" in capsys.readouterr().err
