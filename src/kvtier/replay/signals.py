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
    """Hold SIGINT and SIGTERM until the block ends, then deliver each that arrived.

    For a few statements only: Ctrl-C waits for them. A signal held is delivered also
    when the block raises (its exception then gives way to the signal's, e.g. Ctrl-C's
    KeyboardInterrupt). Outside the main thread, or inside another such block, it does
    nothing more. (Blocking the signals with `pthread_sigmask` would not do: another
    thread of the process can take them.)
    """
    if threading.current_thread() is not threading.main_thread() or _holding[0]:
        yield
        return
    arrived: list[int] = []

    def hold(signum: int, frame: object) -> None:
        arrived.append(signum)

    previous = {int(signum): signal.getsignal(signum) for signum in _HELD}
    raised = _set_handlers(dict.fromkeys(previous, hold))
    try:
        if raised is not None:  # a signal ran its handler while the holds went in
            raise raised
        _holding[0] = True
        yield
    finally:
        _holding[0] = False
        raised = _set_handlers(previous)
        raised = _deliver(arrived, raised)
        if raised is not None:
            raise raised


def _set_handlers(handlers: dict[int, Any]) -> BaseException | None:
    """Install every handler; return what a signal raised on the way (None: nothing).

    A pending signal runs its current handler as `signal.signal` is entered or returns,
    and what that raises comes out of the call, which may or may not have installed the
    new handler: each is set again until it is in place.
    """
    raised: BaseException | None = None
    for signum, handler in handlers.items():
        wanted = signal.SIG_DFL if handler is None else handler
        while signal.getsignal(signum) is not wanted:
            try:
                signal.signal(signum, wanted)
            except BaseException as exc:
                raised = raised or exc
    return raised


def _deliver(arrived: list[int], raised: BaseException | None) -> BaseException | None:
    """Raise each held signal again, in order, under its own handler (one ignored, or
    whose handler returns, lets the next through); return the first exception."""
    for signum in dict.fromkeys(arrived):
        try:
            signal.raise_signal(signum)
        except BaseException as exc:
            raised = raised or exc
    return raised
