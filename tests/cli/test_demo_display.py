"""`kvtier demo`'s consoles: the results' width when stdout is not a terminal, and a
closed pipe.

Found by a mutation run (s29): ignoring COLUMNS for a pipe, and a console that kept
writing to a closed pipe, passed every test.
"""

from __future__ import annotations

import errno
import io

import pytest

from kvtier.cli import demo_display
from kvtier.cli.demo_display import PIPE_WIDTH, DemoConsole, results_console


def test_a_pipe_gets_the_wide_table_unless_columns_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(demo_display.sys, "stdout", io.StringIO())  # not a terminal
    monkeypatch.delenv("COLUMNS", raising=False)
    assert results_console().width == PIPE_WIDTH
    monkeypatch.setenv("COLUMNS", "100")  # the user's width wins
    assert results_console().width == 100


class ClosedPipe(io.StringIO):
    """A stdout whose reader has gone."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_a_closed_pipe_raises_once_then_the_console_is_quiet() -> None:
    """The BrokenPipeError ends the demo (BROKEN_PIPE_STATUS); anything printed on the way
    out must not raise it again."""
    console = DemoConsole(file=ClosedPipe(), width=80)
    with pytest.raises(BrokenPipeError):
        console.print("the table")
    console.print("the verdict")  # quiet: nothing written, nothing raised
