"""What `kvtier demo` shows on a terminal while it runs."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from test_demo_cli_errors import run_demo

from kvtier.cli import demo


def test_a_terminal_is_told_what_runs_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: nothing was shown until the first configuration was served: the
    # model's load and the warm-up (seconds for the demo model, longer for a
    # checkpoint) left a blank terminal.
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=100)
    monkeypatch.setattr(demo, "_console", lambda: terminal)
    assert run_demo(tmp_path, "--disk-io=page_cache") == 0
    text = screen.getvalue()
    positions = [text.find(line) for line in ("loading the model", "warming up", "serving")]
    assert -1 not in positions, text
    assert positions == sorted(positions)
