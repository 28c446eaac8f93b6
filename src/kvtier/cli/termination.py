"""SIGTERM (`timeout`, `kill`) as an exception that unwinds a command, so that its `with`
blocks run and its temporary files go with it.

The handler raises SystemExit(TERMINATED_STATUS) wherever the main thread is. Raised
inside a finalizer or a weak reference's callback, the interpreter swallows it (and
would print it as "Exception ignored", which the block's unraisable hook keeps quiet),
and the command would run on to its end: the request is remembered as well, and
`raise_if_terminated` (called at a command's safe points, e.g. after each demo turn)
raises it again.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

# The status of a command stopped by SIGTERM (`timeout`, `kill`), 128 + 15.
TERMINATED_STATUS = 143

_requested = threading.Event()


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Make SIGTERM raise SystemExit(TERMINATED_STATUS) inside the block.

    Outside the main thread (where no signal handler can be set) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: FrameType | None) -> None:
        _requested.set()
        raise SystemExit(TERMINATED_STATUS)

    previous_hook = sys.unraisablehook

    def quiet_swallowed_exit(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, SystemExit) and _requested.is_set():
            return  # raised again by `raise_if_terminated`
        previous_hook(unraisable)

    _requested.clear()
    previous = signal.signal(signal.SIGTERM, terminate)
    sys.unraisablehook = quiet_swallowed_exit
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        sys.unraisablehook = previous_hook
        _requested.clear()  # handled: later work in this process is not stopped


def raise_if_terminated() -> None:
    """Raise SystemExit(TERMINATED_STATUS) if SIGTERM arrived inside `sigterm_unwinds`
    (its first raise may have been swallowed)."""
    if _requested.is_set():
        raise SystemExit(TERMINATED_STATUS)
