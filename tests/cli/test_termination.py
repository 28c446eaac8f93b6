"""SIGTERM unwinds a command even where its first raise is swallowed.

Regression (a flaky `test_sigterm_stops_the_demo_and_removes_its_disk_tier_folder`): a
SIGTERM landing in a weak reference's callback raised SystemExit there, the interpreter
printed "Exception ignored" and the demo ran on to its end, exiting 0.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import weakref

import pytest

from kvtier.cli.termination import TERMINATED_STATUS, raise_if_terminated, sigterm_unwinds


class _Thing:
    pass


def _sigterm_inside_a_finalizer() -> None:
    """Deliver SIGTERM while a `weakref.finalize` callback runs (which swallows errors)."""

    def callback() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, in the callback's frame

    thing = _Thing()
    weakref.finalize(thing, callback)
    del thing
    gc.collect()


def test_a_swallowed_sigterm_is_raised_at_the_next_safe_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swallowed: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    with sigterm_unwinds():
        _sigterm_inside_a_finalizer()
        assert swallowed == [SystemExit]  # printed as "Exception ignored", not raised
        with pytest.raises(SystemExit) as raised:
            raise_if_terminated()
    assert raised.value.code == TERMINATED_STATUS


def test_a_new_block_starts_without_an_earlier_request() -> None:
    def terminated() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler raises here

    with sigterm_unwinds(), pytest.raises(SystemExit):
        terminated()
    with sigterm_unwinds():
        raise_if_terminated()  # nothing arrived in this block
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
