"""SIGTERM unwinds a command even where its first raise is swallowed.

Regression (a flaky `test_sigterm_stops_the_demo_and_removes_its_disk_tier_folder`): a
SIGTERM landing in a weak reference's callback raised SystemExit there, the interpreter
printed "Exception ignored" with a traceback and the demo ran on to its end, exiting 0.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from finalizers import run_in_a_finalizer, sigterm_inside_a_finalizer
from kvtier.replay.signals import TERMINATED_STATUS, raise_if_terminated, sigterm_unwinds


def test_a_swallowed_sigterm_is_raised_at_the_next_safe_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    printed: list[type[BaseException]] = []  # what the interpreter would print
    monkeypatch.setattr(sys, "unraisablehook", lambda u: printed.append(u.exc_type))
    with sigterm_unwinds():
        sigterm_inside_a_finalizer()  # swallowed there, and not printed as a traceback
        with pytest.raises(SystemExit) as raised:
            raise_if_terminated()
        assert printed == []
        _other_error_inside_a_finalizer()
        assert printed == [ValueError]  # any other swallowed error is still printed
    assert raised.value.code == TERMINATED_STATUS
    assert sys.unraisablehook is not None
    raise_if_terminated()  # handled: later work in this process goes on


def _other_error_inside_a_finalizer() -> None:
    def callback() -> None:
        raise ValueError("a finalizer's own error")

    run_in_a_finalizer(callback)


def test_a_new_block_starts_without_an_earlier_request() -> None:
    def terminated() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler raises here

    with sigterm_unwinds(), pytest.raises(SystemExit):
        terminated()
    with sigterm_unwinds():
        raise_if_terminated()  # nothing arrived in this block
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_system_exit_swallowed_without_sigterm_is_still_printed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the SystemExit of a SIGTERM that arrived is kept quiet: a finalizer's own
    `sys.exit()` is reported as the interpreter would."""
    printed: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: printed.append(u.exc_type))

    def callback() -> None:
        sys.exit(3)

    with sigterm_unwinds():
        run_in_a_finalizer(callback)
    assert printed == [SystemExit]


def test_the_block_puts_back_the_sigterm_handler_and_the_unraisable_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kvtier generate` run by a program (not through `run_command`, which puts back
    its own): the program's SIGTERM handler and unraisable hook are back after."""

    def mine(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    def hook(unraisable: object) -> None:
        raise AssertionError("not called")

    monkeypatch.setattr(sys, "unraisablehook", hook)
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with sigterm_unwinds():
            assert signal.getsignal(signal.SIGTERM) is not mine
            assert sys.unraisablehook is not hook
        assert signal.getsignal(signal.SIGTERM) is mine
        assert sys.unraisablehook is hook
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_block_inside_another_keeps_the_outer_block_s_request() -> None:
    """`kvtier generate` under `run_command`: its block runs inside the command's. A
    SIGTERM swallowed before the inner block began is still raised at the next safe
    point (the inner block's start and end cleared it: the command ran on, exit 0)."""
    with sigterm_unwinds():
        sigterm_inside_a_finalizer()
        with sigterm_unwinds():
            pass
        with pytest.raises(SystemExit) as raised:
            raise_if_terminated()
    assert raised.value.code == TERMINATED_STATUS
    raise_if_terminated()  # handled as the outer block ended
