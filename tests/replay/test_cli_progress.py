"""`kvtier replay`'s progress bar (issue 6: "Progress bar for long traces"): on stderr as
on a terminal, counting every request of every pass, gone when the run ends or is cut
short; none with `--quiet`."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay import cli
from kvtier.replay.trace import write_trace

NUM_REQUESTS = 60


def _argv(tmp_path: Path) -> list[str]:
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=NUM_REQUESTS))
    return [str(trace), "--block-size", str(BLOCK), "--capacity", "40", "--capacity", "80"]


@pytest.fixture
def bar_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draw the bar as on a terminal (tqdm hides it when stderr is not one)."""
    monkeypatch.setattr(cli, "progress_bar_disable", lambda: False)


@pytest.mark.usefixtures("bar_shown")
def test_the_bar_counts_each_request_of_each_pass_and_is_cleared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two capacities, one policy: 2 passes of 60 requests. The bar leaves no line
    behind (the table follows on stdout)."""
    assert cli.main(_argv(tmp_path)) == 0
    err = capsys.readouterr().err
    total = 2 * NUM_REQUESTS
    assert re.match(rf"\r +0%\|.*\| 0/{total} \[", err), err
    assert f"{total}/{total}" not in err
    assert "\n" not in err
    assert err.endswith("\r")
    assert err.rsplit("\r", 2)[1].strip() == ""  # the line cleared


@pytest.mark.usefixtures("bar_shown")
def test_quiet_draws_no_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*_argv(tmp_path), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("bar_shown")
def test_a_run_cut_short_clears_the_bar_before_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C mid-run: the bar's line is cleared, then "interrupted" is written on a
    line of its own (not after the bar, or under a bar drawn again)."""

    def interrupted_sweep(*args: Any) -> None:
        progress: Callable[[int], object] = args[4]
        progress(5)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_sweep", interrupted_sweep)
    assert cli.main(_argv(tmp_path)) == 130
    err = capsys.readouterr().err
    bar, _, message = err.rpartition("\r")
    assert message == "\nkvtier replay: interrupted\n", err
    assert bar.rsplit("\r", 1)[1].strip() == ""  # the last thing drawn: the line cleared
