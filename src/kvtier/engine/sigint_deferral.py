"""Ctrl-C held over a few engine statements that a KeyboardInterrupt must not cut in two.

`SigintDeferral` puts a SIGINT handler in place for its `with` block that only notes the
signal. On leaving the block it puts the handler from before back and, if a signal came,
delivers it as that handler would have: Python's own raises KeyboardInterrupt there, at
the block's end; a program's own handler is called once; SIG_DFL ends the process by
SIGINT. A handler that is SIG_IGN or was set outside Python (`signal.getsignal` None),
and threads other than the main one (no handler can be set there, and no signal handler
runs there), leave everything as it is.

Swapping handlers is safe around a pending signal: `signal.signal` runs the handlers of
pending signals before it swaps, so one that comes as the block begins is handled by the
handler from before (the KeyboardInterrupt comes before the block runs), one that comes
as it ends is noted and delivered. Should putting the handler back fail (another signal's
handler raising inside `signal.signal`), the noting handler left in place hands every
later signal straight to the handler from before.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class SigintDeferral:
    """Hold SIGINT over one `with` block (main thread only); a new one for each block."""

    __slots__ = ("_arrived", "_frame", "_holding", "_previous")

    def __init__(self) -> None:
        self._previous: Any = None  # the handler to put back; None: nothing to put back
        self._holding = False
        self._arrived = False
        self._frame: FrameType | None = None  # where the held signal came

    def __enter__(self) -> SigintDeferral:
        if threading.current_thread() is not threading.main_thread():
            return self
        previous = signal.getsignal(signal.SIGINT)
        if previous is None or previous is signal.SIG_IGN:
            return self
        self._previous, self._holding = previous, True
        signal.signal(signal.SIGINT, self._note)  # a pending signal runs `previous` first
        return self

    def __exit__(self, *exc: object) -> None:
        previous = self._previous
        if previous is None:
            return
        try:
            signal.signal(signal.SIGINT, previous)  # a pending signal runs `_note` first
            self._previous = None
        finally:  # put back or not, a signal from now on goes to `previous`
            self._holding = False
            if self._arrived:
                frame, self._arrived, self._frame = self._frame, False, None
                _deliver(previous, frame)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        """The handler inside the block: note the signal; after it, pass it on."""
        if self._holding:
            if not self._arrived:
                self._arrived, self._frame = True, frame
        elif self._previous is not None:  # `__exit__` could not put `previous` back
            _deliver(self._previous, frame)


def _deliver(handler: Any, frame: FrameType | None) -> None:
    """Do what `handler` does for SIGINT: call it, or take the default action."""
    if handler is signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)  # the end of the process
    elif callable(handler):
        handler(signal.SIGINT, frame)
