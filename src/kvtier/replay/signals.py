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
    """Hold SIGINT and SIGTERM until the block ends, then deliver each that arrived.

    For a few statements only: Ctrl-C waits for them. Outside the main thread, or
    inside another such block, it does nothing more.
    """
    if threading.current_thread() is not threading.main_thread() or _holding[0]:
        yield
        return
    arrived: list[int] = []

    def hold(signum: int, frame: object) -> None:
        arrived.append(signum)

    previous = {int(signum): signal.signal(signum, hold) for signum in _HELD}
    _holding[0] = True
    try:
        yield
    finally:
        _holding[0] = False
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)
