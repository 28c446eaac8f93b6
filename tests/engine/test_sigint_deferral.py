"""`SigintDeferral` on its own: which signal it hands on, and after a failed put-back.

A program's own SIGINT handler (not Python's) is in place for each test, so every
delivery is a call that the test records.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

from kvtier.engine.sigint_deferral import SigintDeferral


@pytest.fixture
def calls() -> Iterator[list[FrameType | None]]:
    """Install a handler recording the frame of each call; put the old one back."""
    received: list[FrameType | None] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(frame)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


def _first_signal() -> None:
    signal.raise_signal(signal.SIGINT)


def _second_signal() -> None:
    signal.raise_signal(signal.SIGINT)


def test_two_signals_in_the_block_are_handed_on_once_with_the_first_ones_frame(
    calls: list[FrameType | None],
) -> None:
    with SigintDeferral():
        _first_signal()
        _second_signal()
        assert calls == [], "a signal was handed on inside the block"
    assert len(calls) == 1
    frame = calls[0]
    assert frame is not None
    assert frame.f_code is _first_signal.__code__, "handed on with a later signal's frame"


def test_after_a_failed_put_back_later_signals_reach_the_handler_from_before(
    calls: list[FrameType | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Putting the handler back raises (as a pending signal's handler raising inside
    `signal.signal` would): the noting handler left in place hands each later signal
    straight on instead of holding it for good."""
    real = signal.signal
    num_calls = []

    def failing_put_back(signum: int, handler: Any) -> Any:
        num_calls.append(handler)
        if len(num_calls) == 2:  # the put-back in `__exit__`
            raise RuntimeError("a handler raised inside signal.signal")
        return real(signum, handler)

    monkeypatch.setattr(signal, "signal", failing_put_back)
    with pytest.raises(RuntimeError), SigintDeferral():
        pass
    monkeypatch.setattr(signal, "signal", real)
    assert calls == []
    _first_signal()
    _second_signal()
    assert len(calls) == 2, "a later signal was held after the block"
