"""A failed disk job waits for every read or write it queued before it raises.

The lane reports the job failed as soon as `DiskMover.store` / `load` raises, and the
next job reuses the staging buffers: an I/O still running into (or out of) one would
then read half-overwritten rows, or overwrite the next job's. The disk tier's I/O
threads are modelled by reads and writes that record whether anyone waited for them.
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.storage.slot_file import DiskIOError
from kvtier.transfer.disk_mover import DiskMover

pytestmark = pytest.mark.timeout(30)

SLOT_BYTES = 8


class WaitedWrite(Future[None]):
    """A finished write's future that records whether its outcome was waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = False
        self.set_result(None)

    def result(self, timeout: float | None = None) -> None:
        self.waited = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.waited = True
        return super().exception(timeout)


class WaitedRead:
    """A `SlotRead` whose `result` raises `error` (if any); records whether it was waited."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error
        self.waited = False

    def result(self) -> None:
        self.waited = True
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        self.waited = True


class FakeDisk:
    """The parts of `DiskTier` a `DiskMover` uses: two buffers per direction of one slot."""

    def __init__(self) -> None:
        self.batch_slots = 1
        self.persistent = False
        self.path = "/fake/kvtier.slots"
        self.store_buffers = [self._buffer() for _ in range(2)]
        self.load_buffers = [self._buffer() for _ in range(2)]
        self.writes: list[WaitedWrite] = []
        self.reads: list[WaitedRead] = []

    @staticmethod
    def _buffer() -> SimpleNamespace:
        return SimpleNamespace(tensor=torch.zeros((1, SLOT_BYTES), dtype=torch.uint8))

    def write_slots(self, buffer: Any, slot_ids: np.ndarray, records: Any = None) -> WaitedWrite:
        self.writes.append(WaitedWrite())
        return self.writes[-1]

    def read_slots(self, buffer: Any, slot_ids: np.ndarray) -> WaitedRead:
        failing = not self.reads  # the first read fails with an I/O error
        error = DiskIOError(5, "Input/output error", self.path) if failing else None
        self.reads.append(WaitedRead(error))
        return self.reads[-1]


class FailingCopier:
    """Copies nothing; its `fail_at`-th staging copy (from 0) raises."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls = 0

    def store_to_staging(self, *args: Any) -> None:
        self.calls += 1
        if self.calls > self.fail_at:
            raise RuntimeError("copy failed")

    def load_from_staging(self, *args: Any) -> None:
        self.calls += 1


def test_a_store_whose_copy_fails_waits_for_the_writes_it_queued() -> None:
    disk = FakeDisk()
    mover = DiskMover(disk, [(0, SLOT_BYTES)], torch.uint8)  # type: ignore[arg-type]
    ids = np.arange(3, dtype=np.int64)
    with pytest.raises(RuntimeError, match="copy failed"):
        mover.store(FailingCopier(fail_at=2), [], ids, ids)  # type: ignore[arg-type]
    assert len(disk.writes) == 2
    assert [w.waited for w in disk.writes] == [True, True], "a queued write was not waited"


def test_a_load_whose_read_fails_waits_for_the_reads_it_queued() -> None:
    disk = FakeDisk()
    mover = DiskMover(disk, [(0, SLOT_BYTES)], torch.uint8)  # type: ignore[arg-type]
    ids = np.arange(3, dtype=np.int64)
    with pytest.raises(DiskIOError, match="Input/output error"):
        mover.load(FailingCopier(fail_at=99), ids, [], ids)  # type: ignore[arg-type]
    assert len(disk.reads) == 2  # one per buffer; the third batch never read
    assert [r.waited for r in disk.reads] == [True, True], "a queued read was not waited"
