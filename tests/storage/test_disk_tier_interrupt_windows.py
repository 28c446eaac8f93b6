"""A Ctrl-C landing in the short windows of a disk tier call: between a manifest call's
registration with the close gate and the code that unregisters it, and after a write was
queued but before `write_slots` returned. Each leaves the tier's books straight."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from test_manifest_durability import tier_config

from kvtier.storage import DiskTier

pytestmark = pytest.mark.timeout(60)

CLOSE_TIMEOUT_S = 10.0


class InterruptError(BaseException):
    """Stands in for KeyboardInterrupt (which pytest would take as a request to stop)."""


class InterruptedAppend(list):  # type: ignore[type-arg]
    """A list whose first `append` adds the item, then raises as a Ctrl-C landing right
    after it would."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def append(self, item: object) -> None:
        super().append(item)
        if not self.interrupted:
            self.interrupted = True
            raise InterruptError


def test_an_interrupt_after_a_manifest_call_registered_does_not_hang_a_close(
    tmp_path: Path,
) -> None:
    """A Ctrl-C right after `forget` registered with the close gate, before the try whose
    finally unregistered it, left the call registered: a close from another thread
    waited for it forever."""
    tier = DiskTier(tier_config(tmp_path))
    working = InterruptedAppend()
    tier._closing._working = working
    with pytest.raises(InterruptError):
        tier.forget([0])
    assert working.interrupted
    closer = threading.Thread(target=tier.close, name="closer", daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT_S)
    assert not closer.is_alive(), "close() from another thread waits for the interrupted call"
