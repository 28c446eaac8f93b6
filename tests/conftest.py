"""Test-wide hygiene: every test starts with the process's SIGINT and SIGTERM handlers.

`kvtier.replay.signals.signals_deferred` wraps them for good on first use (by design:
see that module), and a command's `sigterm_unwinds` puts back whatever it found; without
this, which handler a test sees would depend on the tests that ran before it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)
