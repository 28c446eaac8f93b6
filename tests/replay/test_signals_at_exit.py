"""`kvtier.replay.signals` as a command's process exits: SIGINT given its default action
(`signals_end_the_process`), a Ctrl-C pending as it is kept, and the exit hook
registered once per process (`end_the_process_at_exit`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.replay import signals


def test_a_ctrl_c_pending_as_sigint_gets_its_default_action_is_acted_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pending Ctrl-C runs Python's handler inside `signal.signal` before the swap
    (KeyboardInterrupt): the swap is done again, and the Ctrl-C is raised once more,
    now with its default action (the end of the process; recorded here)."""
    real_signal = signal.signal
    pending = [True]
    raised: list[int] = []

    def swap(signum: int, handler: Any) -> Any:
        if signum == signal.SIGINT and handler is signal.SIG_DFL and pending:
            pending.clear()
            raise KeyboardInterrupt  # Python's handler, run in place
        return real_signal(signum, handler)

    previous = real_signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(signal, "signal", swap)
        monkeypatch.setattr(signal, "raise_signal", raised.append)
        signals.signals_end_the_process()
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        real_signal(signal.SIGINT, previous)
    assert raised == [signal.SIGINT]


def test_the_exit_hook_is_registered_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that runs `main` many times registers one hook, not one per run."""
    registered: list[Callable[[], None]] = []
    monkeypatch.setattr(signals, "_at_exit_registered", False)
    monkeypatch.setattr(threading, "_register_atexit", registered.append)
    signals.end_the_process_at_exit()
    signals.end_the_process_at_exit()
    assert registered == [signals._end_the_process]
