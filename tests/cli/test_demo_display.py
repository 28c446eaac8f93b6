"""`kvtier demo`'s consoles: the results' width when stdout is not a terminal, a closed
pipe, and log records beside the live display."""

from __future__ import annotations

import errno
import io
import logging
import sys

import pytest

from kvtier.cli import demo_display
from kvtier.cli.demo_display import (
    PIPE_WIDTH,
    DemoConsole,
    logs_above_display,
    results_console,
)


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


def test_the_wide_console_of_a_pipe_ends_the_demo_on_a_closed_pipe_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The console made PIPE_WIDTH wide for a pipe is a DemoConsole too: rich's own
    handler would exit 1, as for a failed run. Found by a mutation run (s32): a plain
    Console there passed every test (the closed-pipe test's subprocess inherits COLUMNS
    from the test run, so it takes the other branch)."""
    monkeypatch.setattr(demo_display.sys, "stdout", ClosedPipe())  # not a terminal
    monkeypatch.delenv("COLUMNS", raising=False)
    console = results_console()
    assert console.width == PIPE_WIDTH
    with pytest.raises(BrokenPipeError):
        console.print("the table")


class Proxy(io.StringIO):
    """What a rich live display puts in sys.stderr: it prints above the display."""

    def __init__(self, proxied: io.StringIO) -> None:
        super().__init__()
        self.rich_proxied_file = proxied


def test_log_records_go_through_the_display_while_it_shows_and_back_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a mutation run (s29): a handler left on the display's proxy once the
    display ended passed every test."""
    stderr, other = io.StringIO(), io.StringIO()
    handler, elsewhere = logging.StreamHandler(stderr), logging.StreamHandler(other)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [*root.handlers, handler, elsewhere])
    proxy = Proxy(stderr)
    monkeypatch.setattr(sys, "stderr", proxy)
    with logs_above_display():
        assert (handler.stream, elsewhere.stream) == (proxy, other)  # stderr's only
    assert (handler.stream, elsewhere.stream) == (stderr, other)
