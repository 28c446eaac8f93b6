"""The disk tier's I/O plumbing on its own (`disk_io`): an I/O thread refuses calls after
its shutdown and never joins itself, a claim is taken once, slot id checks at both ends
of the range, and the runs of consecutive ids a batch becomes."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import Future

import numpy as np
import pytest
from storage_helpers import WAIT_S

from kvtier.storage.disk_io import (
    Claim,
    IoThread,
    check_slot_ids,
    consecutive_runs,
    slot_id_list,
)

pytestmark = pytest.mark.timeout(60)


def test_an_io_thread_refuses_calls_after_its_shutdown() -> None:
    """A call queued behind the stop would never run, and its future never resolve."""
    threads: set[threading.Thread] = set()
    io = IoThread("store", threads)
    ran: list[int] = []
    io.submit(ran.append, 1).result(WAIT_S)
    io.shutdown()
    with pytest.raises(RuntimeError, match="kvtier-disk-store: cannot queue I/O after shutdown"):
        io.submit(ran.append, 2)
    io.shutdown()  # idempotent
    assert ran == [1]
    (thread,) = threads
    assert not thread.is_alive()


def test_an_io_thread_shut_down_from_its_own_call_does_not_join_itself() -> None:
    """A done-callback on the thread may shut it down: it returns (no 'cannot join
    current thread'), the calls queued before the stop still run, and the thread ends."""
    threads: set[threading.Thread] = set()
    io = IoThread("load", threads)
    ran: list[str] = []
    release = threading.Event()
    io.submit(release.wait, WAIT_S)  # holds the thread: both calls below are queued first
    first = io.submit(io.shutdown)
    second: Future[None] = io.submit(ran.append, "queued before the stop")
    release.set()
    first.result(WAIT_S)
    second.result(WAIT_S)
    assert ran == ["queued before the stop"]
    (thread,) = threads
    assert thread.name == "kvtier-disk-load"
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_claim_is_taken_once() -> None:
    claim = Claim()
    assert claim.take()
    assert not claim.take()
    assert Claim().take()


@pytest.mark.parametrize("num_slots", [1, 8])
def test_slot_ids_are_checked_at_both_ends_of_the_range(num_slots: int) -> None:
    last = num_slots - 1
    check_slot_ids(np.array([0, last]), num_slots)
    assert slot_id_list([0, np.int32(last)], num_slots) == [0, last]
    for bad in (-1, num_slots):
        with pytest.raises(ValueError, match=rf"outside \[0, {num_slots}\): \[{bad}\]"):
            check_slot_ids(np.array([bad]), num_slots)
        with pytest.raises(ValueError, match=rf"outside \[0, {num_slots}\): \[{bad}\]"):
            slot_id_list([bad], num_slots)


def test_check_slot_ids_accepts_unsigned_and_empty_arrays() -> None:
    check_slot_ids(np.array([3], dtype=np.uint32), 4)
    check_slot_ids(np.array([], dtype=np.int64), 4)


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([], []),
        ([5], [(0, 1)]),
        ([1, 2, 3], [(0, 3)]),
        ([1, 3, 4], [(0, 1), (1, 3)]),
        ([4, 3], [(0, 1), (1, 2)]),  # going down is not a run
        ([2, 2], [(0, 1), (1, 2)]),  # nor is a repeat
        ([7, 8, 0, 1, 5], [(0, 2), (2, 4), (4, 5)]),
    ],
)
def test_consecutive_runs_go_up_by_exactly_one(ids: list[int], runs: list[tuple[int, int]]) -> None:
    assert consecutive_runs(np.array(ids, dtype=np.int64)) == runs


def test_a_call_cancelled_while_queued_never_runs_and_the_thread_goes_on() -> None:
    threads: set[threading.Thread] = set()
    io = IoThread("store", threads)
    release = threading.Event()
    ran: list[str] = []
    blocking = io.submit(release.wait, WAIT_S)
    cancelled = io.submit(ran.append, "cancelled")
    assert cancelled.cancel()
    release.set()
    blocking.result(WAIT_S)
    io.submit(ran.append, "after").result(WAIT_S)
    io.shutdown()
    assert ran == ["after"]


def test_a_call_raising_keyboard_interrupt_fails_its_future_and_the_thread_goes_on() -> None:
    """Any exception of a call, a BaseException such as KeyboardInterrupt included, is
    its future's to raise: the thread serves the next call (else every later future would
    wait for good). Mutants (s35): only Exception caught, or the keyword arguments
    dropped, passed every storage test."""
    threads: set[threading.Thread] = set()
    io = IoThread("load", threads)

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        io.submit(interrupted).result(WAIT_S)
    ran: list[str] = []
    io.submit(ran.append, "after").result(WAIT_S)
    io.submit(ran.append, "b").result(WAIT_S)
    io.submit(ran.sort, key=len).result(WAIT_S)  # keyword arguments reach the call
    io.shutdown()
    assert ran == ["b", "after"]


def test_an_io_thread_dropped_without_shutdown_stops_its_thread() -> None:
    """The thread holds only the queue: once the `IoThread` is collected, its thread ends
    rather than waiting on the queue for good. Mutant (s35): no finalizer passed every
    storage test."""
    threads: set[threading.Thread] = set()
    io = IoThread("store", threads)
    io.submit(int).result(WAIT_S)
    del io
    gc.collect()
    (thread,) = threads
    thread.join(WAIT_S)
    assert not thread.is_alive()
