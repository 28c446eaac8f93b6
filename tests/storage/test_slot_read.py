"""`SlotRead` on its own: `result()` verifies the slots only once their read finished
(and not at all when it failed), and `wait()` returns only once the read finished, its
outcome ignored: the staging buffer is free again for the next read or write only then."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from storage_helpers import join_all, start_until_parked

from kvtier.storage.slot_file import DiskIOError
from kvtier.storage.staging import SlotRead

pytestmark = pytest.mark.timeout(60)


def test_result_verifies_only_a_finished_read() -> None:
    checks: list[bool] = []
    future: Future[None] = Future()
    read = SlotRead(future, lambda: checks.append(future.done()))
    future.set_result(None)
    read.result()
    assert checks == [True]
    failed: Future[None] = Future()
    failed.set_exception(DiskIOError(5, "Input/output error", "/cache/rank0.slots"))
    with pytest.raises(DiskIOError, match="Input/output error"):
        SlotRead(failed, lambda: checks.append(failed.done())).result()
    assert checks == [True]  # a failed read's bytes are never checked


def test_wait_returns_once_the_read_finished_whatever_its_outcome() -> None:
    future: Future[None] = Future()
    read = SlotRead(future, lambda: None)
    waiter = start_until_parked(read.wait, "waiter")
    assert waiter.is_alive()  # the read is still running: the buffer is not free
    future.set_exception(DiskIOError(5, "Input/output error", "/cache/rank0.slots"))
    join_all(waiter)
