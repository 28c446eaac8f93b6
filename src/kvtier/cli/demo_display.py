"""Where `kvtier demo` writes: its results on stdout, its status line and progress bar on
stderr when that is a terminal, and log records above that display, not across it."""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

PIPE_WIDTH = 160  # columns of the table when output is not a terminal


class DemoConsole(Console):
    """A rich Console whose closed pipe ends the demo as it ends kvtier's other commands."""

    def on_broken_pipe(self) -> None:
        """Raise BrokenPipeError, which `kvtier` ends quietly with BROKEN_PIPE_STATUS.

        Rich's own handler raised SystemExit(1): `kvtier demo | head -2` exited 1, as
        for a failed run, not 141 as `kvtier replay | head -1` does.
        """
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def results_console() -> Console:
    """Return the console of the results (stdout); wide enough for the tables when
    output is not a terminal.

    Rich sizes a console that writes to a pipe or file (`make demo | tee`, CI logs) at 80
    columns unless COLUMNS says otherwise, which truncates every cell of the table.
    """
    console = DemoConsole()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = DemoConsole(width=PIPE_WIDTH)
    return console


def progress_console() -> Console:
    """Return the console of the demo's status line and progress bar: stderr's.

    On stdout's, they showed only when stdout was a terminal: `kvtier demo > out.txt`
    and `make demo | tee log` ran for minutes without a sign of progress.
    """
    return DemoConsole(stderr=True)


@contextmanager
def status(console: Console, text: str) -> Iterator[None]:
    """Show a transient status line on `console` in the block if it is a terminal."""
    if not console.is_terminal:
        yield
        return
    with console.status(text), logs_above_display():
        yield


@contextmanager
def logs_above_display() -> Iterator[None]:
    """Inside a rich live display, send the root logger's stderr records through it.

    The display replaces sys.stderr with a proxy that prints above it, but the handler
    `kvtier -v` logs through holds the stderr it was made with: its lines ran into the
    progress bar's ("25% 0:00:04INFO kvtier.transfer.worker: ...").
    """
    proxy = sys.stderr
    stderr = getattr(proxy, "rich_proxied_file", None)  # set by the live display
    handlers = [
        handler
        for handler in logging.getLogger().handlers
        if isinstance(handler, logging.StreamHandler) and handler.stream is stderr
    ]
    if stderr is None or not handlers:
        yield
        return
    for handler in handlers:
        handler.setStream(proxy)
    try:
        yield
    finally:
        for handler in handlers:
            handler.setStream(stderr)
