"""`kvtier generate` stopped by SIGTERM whose first raise a finalizer swallowed: it ends
with status 143 at its next safe point, as `kvtier demo` and `kvtier replay` do, and
leaves no trace file behind."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from finalizers import sigterm_inside_a_finalizer
from kvtier.cli.main import main as kvtier_main
from kvtier.replay import generate


@pytest.mark.parametrize(
    "run",
    [generate.main, lambda argv: kvtier_main(["generate", *argv])],
    ids=["python -m kvtier.replay.generate", "kvtier generate"],
)
def test_a_sigterm_swallowed_as_the_trace_is_made_stops_the_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Callable[[list[str]], int]
) -> None:
    """Regression: the generator wrote the trace and exited 0 (its block then forgot the
    request, so `kvtier generate`'s own check after the command saw none either)."""
    made = generate._generate_with_progress

    def made_as_sigterm_is_swallowed(config: generate.ChatWorkloadConfig) -> object:
        records = made(config)
        sigterm_inside_a_finalizer()
        return records

    monkeypatch.setattr(generate, "_generate_with_progress", made_as_sigterm_is_swallowed)
    out = tmp_path / "chat.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        run([str(out), "--conversations", "2"])
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == []
