"""SIGTERM and Ctrl-C around the files `kvtier replay` and the trace generator write.

`sigterm_unwinds` turns SIGTERM into an exception, so that `with` blocks remove their
temporary files (the default action kills the process on the spot). `signals_deferred`
holds SIGINT and SIGTERM over a few statements that must not be cut in two (a file
created and its removal registered; a set of files renamed into place), then delivers
them as their handlers would have.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

TERMINATED_STATUS = 143  # 128 + SIGTERM: what a shell reports for `kill` and `timeout`
_HELD = (signal.SIGINT, signal.SIGTERM)
_holding = [False]  # inside `signals_deferred` (main thread only): nested blocks join it


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Make SIGTERM (`kill`, `timeout`) raise SystemExit(TERMINATED_STATUS) inside the block.

    Does nothing outside the main thread (no handler can be set there).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(TERMINATED_STATUS)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver the first that arrived.

    For a few statements only: Ctrl-C waits for them. The first signal's handler stops
    the command, so a second one would find it stopping. Outside the main thread, or
    inside another such block, it does nothing more. (Blocking the signals with
    `pthread_sigmask` would not do: another thread of the process can take them.)
    """
    if threading.current_thread() is not threading.main_thread() or _holding[0]:
        yield
        return
    arrived: list[int] = []

    def hold(signum: int, frame: object) -> None:
        arrived.append(signum)

    previous: dict[int, Any] = {}
    try:
        for signum in _HELD:  # a pending signal may run (and raise) as signal() returns
            previous[int(signum)] = signal.getsignal(signum)
            signal.signal(signum, hold)
        _holding[0] = True
        yield
    finally:
        _holding[0] = False
        _restore(previous)
    if arrived:
        signal.raise_signal(arrived[0])


def _restore(previous: dict[int, Any]) -> None:
    """Put every handler back, even when a signal runs one (and raises) on the way."""
    raised: BaseException | None = None
    for signum, handler in previous.items():
        try:
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        except BaseException as exc:  # the handler just restored ran and raised
            raised = raised or exc
    if raised is not None:
        raise raised
