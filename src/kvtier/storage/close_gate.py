"""Close a storage component once, however many threads call its `close()`.

A `close()` that marks the component closed and then flushes lets a second caller return
while the first is still flushing: that caller believes the files are synced, removed or
unlocked when they are not. A `CloseGate` makes every caller return only once the close
has finished:

    caller                                   run(action)
    first                                    runs `action`
    another thread, while it runs            waits for it, then returns (or runs it
                                             again if it raised)
    the thread running it (a finalizer run   returns at once: waiting would wait for
    by a garbage collection inside it)       itself
    any, once it completed                   returns at once

Calls that must finish before the close (the body of a `with gate.working()`: a manifest
append) are refused once it began, and the close waits for those already running in
other threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["CloseGate"]


@dataclass(eq=False, slots=True)
class _Work:
    """One call the close waits for, compared by identity (a thread may hold several)."""

    thread: int  # ident of the thread running it


class CloseGate:
    """The close state of one component: open, closing (new work refused), closed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._runner: int | None = None  # ident of the thread running the action
        self._is_closing = False
        self._is_closed = False
        self._working: list[_Work] = []  # the calls inside `working()`

    @property
    def is_closing(self) -> bool:
        """Return True once a close began (it may not have finished): refuse new work."""
        return self._is_closing

    @property
    def is_closed(self) -> bool:
        """Return True once a close completed."""
        return self._is_closed

    @contextlib.contextmanager
    def working(self) -> Iterator[bool]:
        """Hold off the close for the `with` body; yield False (nothing held: refuse the
        call) once a close began.

        The call is registered and unregistered inside one try/finally, so an exception
        anywhere (a KeyboardInterrupt right after the registration) leaves no entry that
        a close in another thread would wait for forever."""
        work = _Work(threading.get_ident())
        try:
            with self._cond:
                is_open = not self._is_closing
                if is_open:
                    self._working.append(work)
            yield is_open
        finally:
            with self._cond:
                if work in self._working:
                    self._working.remove(work)
                    self._cond.notify_all()

    def mark_closing(self) -> None:
        """Refuse new work from now on, for a close that another thread is about to run."""
        with self._cond:
            self._is_closing = True

    def run(self, action: Callable[[], None]) -> None:
        """Run `action` unless it completed; while another thread runs it, wait for it.

        Calls inside `working()` in other threads finish first. An `action` that
        raises leaves the gate closing but not closed: the exception goes to its caller,
        and the next caller (a waiting one included) runs it again, so `action` must be
        safe to repeat. A call from the thread running `action` returns at once.
        """
        me = threading.get_ident()
        with self._cond:
            self._is_closing = True
            while self._runner not in (None, me) or any(w.thread != me for w in self._working):
                self._cond.wait()
            if self._is_closed or self._runner == me:
                return
            self._runner = me
        completed = False
        try:
            action()
            completed = True
        finally:
            with self._cond:
                self._runner = None
                self._is_closed = completed
                self._cond.notify_all()
