"""`signals_deferred`: signals held until the outermost block ends, delivered in order,
the first handler's exception raised, and one arriving as the hold ends not lost."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from kvtier.replay import signals
from kvtier.replay.signals import signals_deferred, sigterm_unwinds


@pytest.fixture
def pythons_sigint() -> Iterator[None]:
    """SIGINT raising KeyboardInterrupt, whatever the runner set."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the (holding) handler runs here


@pytest.mark.usefixtures("pythons_sigint")
def test_a_nested_block_holds_until_the_outermost_ends() -> None:
    reached: list[str] = []

    def nested() -> None:
        with signals_deferred():
            with signals_deferred():
                _ctrl_c()
            reached.append("after the inner block")

    with pytest.raises(KeyboardInterrupt):
        nested()
    assert reached == ["after the inner block"]


@pytest.mark.usefixtures("pythons_sigint")
def test_the_first_held_signal_s_exception_is_raised() -> None:
    """Ctrl-C, then SIGTERM: both handlers run in order; KeyboardInterrupt is raised."""

    def both_signals() -> None:
        with sigterm_unwinds(), signals_deferred():
            _ctrl_c()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)

    with pytest.raises(KeyboardInterrupt):
        both_signals()


@pytest.mark.usefixtures("pythons_sigint")
def test_a_signal_arriving_as_the_hold_ends_is_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C whose holding handler runs after the held ones were delivered, before
    the block's depth drops to 0, is still delivered (not left queued)."""
    real_deliver = signals._deliver_held
    late = [True]

    def deliver_then_a_ctrl_c_arrives() -> None:
        real_deliver()
        if late:
            late.clear()
            signals._state.arrived.append((signal.SIGINT, signal.default_int_handler))

    monkeypatch.setattr(signals, "_deliver_held", deliver_then_a_ctrl_c_arrives)
    with pytest.raises(KeyboardInterrupt), signals_deferred():
        pass
    assert signals._state.arrived == []
    assert signals._state.depth == 0


@pytest.mark.parametrize("handler", [signal.SIG_DFL, None], ids=["SIG_DFL", "set-outside-python"])
def test_a_held_signal_with_the_default_action_is_raised_with_it(
    monkeypatch: pytest.MonkeyPatch, handler: object
) -> None:
    """SIGTERM held whose handler was the default action (or one set outside Python,
    which `signal.getsignal` gives as None): at the block's end SIGTERM gets its default
    action back, then is raised (which ends the process; recorded here)."""
    real_getsignal = signal.getsignal
    raised: list[tuple[int, object]] = []

    def getsignal(signum: int) -> object:
        return handler if signum == signal.SIGTERM else real_getsignal(signum)

    def raise_signal(signum: int) -> None:
        raised.append((signum, real_getsignal(signum)))

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        monkeypatch.setattr(signal, "getsignal", getsignal)
        monkeypatch.setattr(signal, "raise_signal", raise_signal)
        with signals_deferred():
            monkeypatch.setattr(signal, "getsignal", real_getsignal)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # held by the wrapper
        assert raised == [(signal.SIGTERM, signal.SIG_DFL)]
    finally:
        signal.signal(signal.SIGTERM, previous)
