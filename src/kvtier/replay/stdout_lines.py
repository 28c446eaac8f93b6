"""`StdoutLines`: what `kvtier replay` prints, quiet once its reader has gone."""

from __future__ import annotations

import os
import sys


class StdoutLines:
    """Print lines to stdout (or stderr); once stdout's reader has gone (a broken pipe:
    `reader_left`), drop them quietly. A stdout closed from the start (`>&-`, so
    `sys.stdout` is None) takes nothing either."""

    def __init__(self, to_stderr: bool = False) -> None:
        self.is_closed = sys.stdout is None
        self.reader_left = False
        self.to_stderr = to_stderr

    def print(self, text: str) -> None:
        """Print `text` and a newline, unless the reader has gone."""
        if self.to_stderr:
            self._print_to_stderr(text)
        elif not self.is_closed:
            try:
                print(text)
            except BrokenPipeError:
                self.close()

    def _print_to_stderr(self, text: str) -> None:
        """Print to stderr (stdout carries the JSON); a closed or gone stderr takes
        nothing, and never counts as stdout's reader leaving."""
        if sys.stderr is None:  # closed (`2>&-`): print() would fall back on stdout
            return
        try:
            print(text, file=sys.stderr)
        except BrokenPipeError:
            self.to_stderr = False
            self.is_closed = True  # nothing more to print; stdout keeps the JSON alone

    def flush(self) -> None:
        """Flush stdout (a closed pipe shows here, not at interpreter exit)."""
        if not self.is_closed:
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                self.close()

    def close(self) -> None:
        """Note that stdout's reader has gone: print nothing more to it, and point its
        descriptor at the null device so that no later flush fails again."""
        self.reader_left = True
        if self.is_closed:
            return
        self.is_closed = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # no real file descriptor (captured output)
            pass
        finally:
            os.close(devnull)


def progress_bar_disable() -> bool | None:
    """Return tqdm's `disable` for a command's progress bar: None (a bar on a terminal
    only), or True when stderr is closed (`2>&-`), where tqdm would fail to write."""
    return True if sys.stderr is None else None
