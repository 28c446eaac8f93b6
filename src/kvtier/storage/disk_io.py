"""The disk tier's I/O plumbing: the I/O threads (`IoThread`), the claim that decides
whether a queued call runs or was withdrawn (`Claim`), the check of a batch's slot ids,
and the runs of consecutive slot ids a batch becomes (one read or write each)."""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from queue import SimpleQueue
from typing import ParamSpec

import numpy as np

_P = ParamSpec("_P")
_Call = tuple[Future[None], Callable[[], None]]


class IoThread:
    """One thread that runs submitted calls in order: a disk tier's store or load I/O.

    It keeps working while the interpreter exits, until `shutdown`: an atexit callback
    (an engine's `shutdown()`) may still queue I/O and wait for it. A
    `ThreadPoolExecutor`'s threads are stopped before any atexit callback runs, and every
    later submit is refused: the transfers an exit-time shutdown waited for failed. The
    thread is a daemon holding only its queue (a non-daemon one blocked on it would keep
    the interpreter from reaching atexit), started at the first submit, and added to
    `threads` then: the thread object, not its ident, which a later thread may reuse.
    Whoever owns files the calls use stops it (`shutdown`) before closing them.
    """

    def __init__(self, side: str, threads: set[threading.Thread]) -> None:
        self._name = f"kvtier-disk-{side}"
        self._threads = threads
        self._calls: SimpleQueue[_Call | None] = SimpleQueue()
        self._lock = threading.Lock()  # orders submits against `shutdown`'s stop
        self._thread: threading.Thread | None = None
        self._is_shut_down = False
        # Dropped: stop the thread. Not at exit, where the tier's own finalizer stops it
        # once its queued I/O is done (see `disk_tier_close.close_dropped`).
        weakref.finalize(self, self._calls.put, None).atexit = False

    def submit(self, fn: Callable[_P, None], *args: _P.args, **kwargs: _P.kwargs) -> Future[None]:
        """Queue `fn(*args, **kwargs)` behind the earlier calls; return its future.

        RuntimeError once `shutdown` began, or when the thread cannot start."""
        future: Future[None] = Future()
        with self._lock:
            if self._is_shut_down:
                raise RuntimeError(f"{self._name}: cannot queue I/O after shutdown")
            if self._thread is None:
                thread = threading.Thread(
                    target=_serve, args=(self._calls,), name=self._name, daemon=True
                )
                thread.start()
                self._threads.add(thread)
                self._thread = thread
            self._calls.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def shutdown(self) -> None:
        """Refuse new calls, then wait for the queued ones (unless called from the thread
        itself); idempotent, and a wait cut short by an interrupt is redone by the next
        call."""
        with self._lock:
            if not self._is_shut_down:
                self._is_shut_down = True
                self._calls.put(None)  # behind the queued calls
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


class Claim:
    """Decide once between the I/O thread starting a queued call and its caller
    withdrawing it after an exception: the first `take` wins, whoever calls it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # acquired, never released, by the winner

    def take(self) -> bool:
        """Return True for the first call only; thread-safe, never blocks."""
        return self._lock.acquire(blocking=False)


def _serve(calls: SimpleQueue[_Call | None]) -> None:
    """An I/O thread: run queued calls in order until the `None` that stops it."""
    while (item := calls.get()) is not None:
        future, call = item
        del item
        if future.set_running_or_notify_cancel():
            try:
                call()
            except BaseException as exc:  # the caller's to raise, from the future
                future.set_exception(exc)
            else:
                future.set_result(None)
        del future, call  # hold no buffer, nor the tier, while idle


def check_slot_ids(slot_ids: object, num_slots: int) -> None:
    """Raise ValueError naming `slot_ids` unless it is a 1-D integer array of ids in
    `[0, num_slots)` (floats would be truncated, a bool array taken as a mask)."""
    if (
        not isinstance(slot_ids, np.ndarray)
        or slot_ids.ndim != 1
        or slot_ids.dtype.kind not in "iu"
    ):
        what = (
            f"{slot_ids.dtype} array of shape {slot_ids.shape}"
            if isinstance(slot_ids, np.ndarray)
            else type(slot_ids).__name__
        )
        raise ValueError(f"slot ids must be a 1-D integer array, got a {what}: {slot_ids!r}")
    if len(slot_ids) and (slot_ids.min() < 0 or slot_ids.max() >= num_slots):
        raise ValueError(f"slot ids outside [0, {num_slots}): {slot_ids.tolist()}")


def slot_id_list(slots: Sequence[object], num_slots: int) -> list[int]:
    """Return `slots` as ints; raise ValueError naming those that are not integers
    (`int()` would truncate a float or parse a string) or outside `[0, num_slots)`."""
    ids: list[int] = []
    odd: list[object] = []
    for slot in slots:
        if isinstance(slot, (int, np.integer)) and not isinstance(slot, bool):
            ids.append(int(slot))
        else:
            odd.append(slot)
    if odd:
        raise ValueError(f"slot ids must be integers, got {odd}")
    bad = [slot for slot in ids if not 0 <= slot < num_slots]
    if bad:
        raise ValueError(f"slot ids outside [0, {num_slots}): {bad}")
    return ids


def consecutive_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Return `[a, b)` index ranges over which `ids` goes up by exactly one."""
    if len(ids) == 0:
        return []
    cuts = [0, *(np.flatnonzero(np.diff(ids) != 1) + 1).tolist(), len(ids)]
    return list(itertools.pairwise(cuts))
