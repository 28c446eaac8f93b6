"""A Ctrl-C landing in the short windows of a disk tier call: between a manifest call's
registration with the close gate and the code that unregisters it, and after a write was
queued but before `write_slots` returned. Each leaves the tier's books straight."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from queue import SimpleQueue

import numpy as np
import pytest
from storage_helpers import collect
from test_manifest_durability import rec, tier_config

from kvtier.storage import DiskTier
from kvtier.storage.slot_file import SlotFile

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


class HeldFirstWrite:
    """Hold the tier's first slot write until `release`; `started` is set once it runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self._release = threading.Event()
        real = SlotFile.write

        def write(slot_file: SlotFile, data: memoryview, first_slot: int) -> None:
            if not self.started.is_set():
                self.started.set()
                assert self._release.wait(30), "the held write was never released"
            real(slot_file, data, first_slot)

        monkeypatch.setattr(SlotFile, "write", write)

    def release(self) -> None:
        self._release.set()


class InterruptedPut(SimpleQueue):  # type: ignore[type-arg]
    """The store I/O queue: its `n`-th put (from 0) queues the call, then raises as a
    Ctrl-C landing in `IoThread.submit` right after it would."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self._count = 0
        self._n = n

    def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        n, self._count = self._count, self._count + 1
        if n == self._n:
            raise InterruptError


def one(slot: int) -> np.ndarray:
    return np.array([slot], dtype=np.int64)


def recovered_slots(tmp_path: Path) -> list[int]:
    tier = DiskTier(tier_config(tmp_path))
    try:
        return [slot for slot, _ in tier.recovered_slots()]
    finally:
        tier.close()


def finish(tier: DiskTier, held: HeldFirstWrite) -> None:
    """Release the held write; then a last write, alone in the queue, must commit its
    record when it ends (with every other pending one) as the queue is idle."""
    held.release()
    tier.write_slots(tier.store_buffers[1], one(9), [rec(9)]).result()
    assert tier._records.pending is not None
    assert len(tier._records.pending) == 0, "records wait although the store queue is idle"
    tier.check_invariants()
    tier.close()


def test_a_write_interrupted_in_submit_after_it_was_queued_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a Ctrl-C in `IoThread.submit` after the write was queued ran
    `write_slots`' except branch, which counted the write done, and the I/O thread counted
    it again once it ran it: the queued-writes count went to -1, and later group commits
    waited for the size or age limit instead of the idle queue. Now the write, not yet
    started (the I/O thread is busy with an earlier one), is withdrawn: it never runs."""
    tier = DiskTier(tier_config(tmp_path))
    tier._store_io._calls = InterruptedPut(1)
    held = HeldFirstWrite(monkeypatch)
    first = tier.write_slots(tier.store_buffers[0], one(1), [rec(1)])
    assert held.started.wait(30)
    with pytest.raises(InterruptError):
        tier.write_slots(tier.store_buffers[1], one(5), [rec(5)])
    finish(tier, held)
    first.result()
    assert recovered_slots(tmp_path) == [1, 9]


def test_a_write_interrupted_after_submit_while_it_runs_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a Ctrl-C after `IoThread.submit` returned, before `write_slots` did,
    counted the write done twice as above. The I/O thread had already started it: it
    completes, counted once, by the I/O thread."""
    tier = DiskTier(tier_config(tmp_path))
    held = HeldFirstWrite(monkeypatch)
    real_submit: Callable[..., object] = tier._store_io.submit

    def submit(*args: object) -> object:
        real_submit(*args)  # queued: its future is lost to the interrupt
        assert held.started.wait(30)  # the I/O thread runs the write
        raise InterruptError

    monkeypatch.setattr(tier._store_io, "submit", submit)
    with pytest.raises(InterruptError):
        tier.write_slots(tier.store_buffers[0], one(5), [rec(5)])
    monkeypatch.setattr(tier._store_io, "submit", real_submit)
    finish(tier, held)
    assert recovered_slots(tmp_path) == [5, 9]


def test_a_tier_collected_with_a_pending_record_keeps_it_and_never_the_stale_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record waits for its group commit at collection only after a write withdrawn by
    an interrupt: the earlier write finished while the withdrawn one still counted as
    queued (not idle: no commit), and the withdrawal commits nothing. Collected without
    close(), the tier lost that record before this test: the next run restored nothing
    for the slot (a miss; its earlier run's record, of other bytes, was tombstoned
    before the overwrite, so it never came back, and a slot without a record is never
    served). The finalizer now commits pending records as close() does."""
    tier = DiskTier(tier_config(tmp_path))
    tier.write_slots(tier.store_buffers[0], one(5), [rec(1)]).result()  # another run's
    tier.close()
    tier = DiskTier(tier_config(tmp_path))
    assert tier.recovered_slots() == [(5, rec(1))]
    held = HeldFirstWrite(monkeypatch)
    tier.store_buffers[0].tensor[0] = 7
    written = tier.write_slots(tier.store_buffers[0], one(5), [rec(2)])
    assert held.started.wait(30)

    def submit(*args: object) -> object:  # the second write, counted queued
        held.release()
        written.result()  # the first ends while the second counts as queued
        raise InterruptError  # before it was queued: withdrawn

    monkeypatch.setattr(tier._store_io, "submit", submit)
    with pytest.raises(InterruptError):
        tier.write_slots(tier.store_buffers[1], one(9), [rec(9)])
    assert tier._records.pending is not None
    assert len(tier._records.pending) == 1
    monkeypatch.undo()
    ref = weakref.ref(tier)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del tier, submit
        collect(ref)
    assert [w.category for w in caught] == [ResourceWarning]
    tier = DiskTier(tier_config(tmp_path))
    try:
        assert tier.recovered_slots() == [(5, rec(2))]
        tier.read_slots(tier.load_buffers[0], one(5)).result()
        assert bool((tier.load_buffers[0].tensor[0] == 7).all())
    finally:
        tier.close()
