"""Run code inside a `weakref.finalize` callback, which swallows what it raises: how a
SIGTERM's SystemExit can get lost, for the termination tests."""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref
from collections.abc import Callable


class _Thing:
    pass


def run_in_a_finalizer(callback: Callable[[], object]) -> None:
    """Run `callback` as the finalizer of an object collected now."""
    thing = _Thing()
    weakref.finalize(thing, callback)
    del thing
    gc.collect()


def sigterm_inside_a_finalizer() -> None:
    """Deliver SIGTERM while a `weakref.finalize` callback runs (which swallows errors)."""

    def callback() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, in the callback's frame

    run_in_a_finalizer(callback)
