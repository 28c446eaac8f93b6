"""`kvtier generate`'s progress bars: on stderr on a terminal while the trace is made
and while it is written, none off one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.replay import generate, trace
from kvtier.replay.generate import ChatWorkloadConfig, generate_chat_trace
from kvtier.replay.generate import main as generate_main
from kvtier.replay.trace import read_trace

ARGS = ["--conversations", "3", "--block-size", "64"]


def test_no_bar_is_drawn_when_stderr_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chat.jsonl.gz"
    assert generate_main([str(out), *ARGS]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith("wrote ")
    config = ChatWorkloadConfig(num_conversations=3, block_size=64)
    assert read_trace(out, block_size=64) == generate_chat_trace(config)


def test_the_trace_is_written_under_a_bar_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the bar counted the requests as they were made only; writing them
    gzipped took as long again (17 s at 8.5 M block references) with no sign of it."""
    monkeypatch.setattr(generate, "progress_bar_disable", lambda: False)  # as on a terminal
    counts: list[tuple[int, int]] = []

    def write_trace(path: str, records: Any) -> None:
        trace.write_trace(path, records)
        counts.append((getattr(records, "n", None), getattr(records, "total", None)))

    monkeypatch.setattr(generate, "write_trace", write_trace)
    out = tmp_path / "chat.jsonl.gz"
    assert generate_main([str(out), *ARGS]) == 0
    captured = capsys.readouterr()
    num_requests = len(read_trace(out, block_size=64))
    assert counts == [(num_requests, num_requests)]
    assert re.search(rf"\rwriting: +0%\|.*\| 0/{num_requests} ", captured.err), captured.err
    assert re.search(r"\rgenerating: 0req ", captured.err), captured.err  # its total comes later
    assert captured.out == f"wrote {num_requests} requests to {out}\n"
