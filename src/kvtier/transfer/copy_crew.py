"""The threads a transfer lane splits its CPU block copies over.

A lane runs one job at a time on its thread. Its crew is that thread plus `size - 1`
helper threads: `run` shares a batch of region copies (each planned by
`block_copy.plan_copy`) out in `size` consecutive shares of about equal bytes, runs one
share on the calling thread and hands the others to the helpers, and returns once every
share is done. numpy's gathers and scatters release the GIL, so the shares run in
parallel: one thread moves 9-11 GB/s on these 2 cores, two 24-26 (`block_copy`).

A batch smaller than `MIN_SHARE_BYTES` per thread is copied by fewer threads: a hand-off
(queue, wake-up, wait) costs tens of microseconds, the time of about 1 MiB of copying.
Shares write disjoint rows (a plan's destination ids never repeat), so they never race.

`run` returns, or raises, only after every share stopped: a failed job leaves no copy
running into slots or blocks handed on since. It raises one error, the first failed
share's in batch order (the lane reports one per job), and logs each other one with its
traceback: its type is kept for the lane's callers, and no failure goes untold.

Helpers are daemon threads that hold only their queue, started when a batch first needs
them (a GPU worker's CPU copies, all to or from disk staging, never do; one that cannot
start leaves its share to the lane thread); `close()` (from the lane) or the crew's
garbage collection stops them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from queue import SimpleQueue

import numpy as np
import torch

from kvtier.transfer.block_copy import CopyPlan, CopyStrategy, copy_rows, fits, new_scratch

logger = logging.getLogger(__name__)

MIN_SHARE_BYTES = 1 << 20
# Threads a crew gets when the config leaves it open: torch's intra-op count, up to this.
# A few threads reach a host's copy bandwidth; more only take cores from the engine.
MAX_DEFAULT_SIZE = 4

_Task = tuple[Future[None], Callable[[], None]]
_Scratch = dict[tuple[int, np.dtype], np.ndarray]  # a thread's scratch rows, by row shape


@dataclass(frozen=True, slots=True)
class RegionCopy:
    """One region's part of a batch: `plan` applied from `src` rows to `dst` rows."""

    plan: CopyPlan
    src: np.ndarray
    dst: np.ndarray

    @property
    def row_bytes(self) -> int:
        """Return the bytes of one row."""
        return int(self.src.shape[1]) * self.src.dtype.itemsize


# One share: (index into the batch, first plan row, end plan row), in batch order.
Share = list[tuple[int, int, int]]


def share_out(sizes: Sequence[tuple[int, int]], parts: int) -> list[Share]:
    """Split the rows of items `(rows, bytes per row)` into `parts` consecutive shares of
    about equal bytes, cut at whole rows; a share may be empty (a few large rows)."""
    total = sum(rows * row_bytes for rows, row_bytes in sizes)
    shares: list[Share] = [[] for _ in range(parts)]
    part, done = 0, 0  # the share being filled; bytes given out so far
    for item, (rows, row_bytes) in enumerate(sizes):
        a = 0
        while a < rows:
            bound = total * (part + 1) // parts  # where share `part` ends, in bytes
            if part == parts - 1:
                b = rows
            else:
                b = min(rows, a + max(1, -(-(bound - done) // row_bytes)))
            shares[part].append((item, a, b))
            done += (b - a) * row_bytes
            a = b
            while part < parts - 1 and done >= total * (part + 1) // parts:
                part += 1
    return shares


def crew_size(copy_threads: int | None) -> int:
    """Return the threads of a lane's crew: `copy_threads`, else torch's intra-op thread
    count (which torch's own copies would use) up to `MAX_DEFAULT_SIZE`."""
    if copy_threads is not None:
        return copy_threads
    return max(1, min(torch.get_num_threads(), MAX_DEFAULT_SIZE))


class CopyCrew:
    """The calling (lane) thread plus `size - 1` helper threads, with a scratch apiece.

    `run` is called from one thread at a time (the lane's); `min_share_bytes` is the
    smallest share worth a hand-off (default `MIN_SHARE_BYTES`).
    """

    def __init__(self, size: int, name: str, min_share_bytes: int | None = None) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"a copy crew needs a positive number of threads, got {size!r}")
        self.size = size
        self.min_share_bytes = max(1, min_share_bytes or MIN_SHARE_BYTES)
        self._scratch: list[_Scratch] = [{} for _ in range(size)]
        self._queues: tuple[SimpleQueue[_Task | None], ...] = tuple(
            SimpleQueue() for _ in range(size - 1)
        )
        # Helper i runs member i + 1's shares; started when first handed one.
        self._helpers: list[threading.Thread | None] = [None] * (size - 1)
        self._name = name
        self._closed = False
        # Not at interpreter exit: the lanes still run their queued jobs then (atexit), and
        # daemon helpers need no stopping once the interpreter ends.
        weakref.finalize(self, _stop, self._queues).atexit = False

    def run(self, copies: Sequence[RegionCopy], max_threads: int | None = None) -> None:
        """Copy every region of the batch over at most `max_threads` of the crew's threads
        (None: all); once every share stopped, raise the first failed share's error (in
        batch order) and log the others."""
        if self._closed:
            raise RuntimeError(f"copy crew {self._name} is closed")
        sizes = [(c.plan.num, c.row_bytes) for c in copies]
        total = sum(rows * row_bytes for rows, row_bytes in sizes)
        threads = self.size if max_threads is None else max(1, min(self.size, max_threads))
        parts = max(1, min(threads, total // self.min_share_bytes))
        if parts == 1:  # all on this thread: every region whole
            _copy_share(
                self._scratch[0], copies, [(i, 0, rows) for i, (rows, _) in enumerate(sizes)]
            )
            return
        shares = share_out(sizes, parts)
        handed: list[Future[None]] = []
        kept: list[Share] = []  # shares whose helper could not start: copied here
        try:
            for member in range(1, parts):
                if shares[member] and not self._hand(handed, member, copies, shares[member]):
                    kept.append(shares[member])
            for share in (shares[0], *kept):  # one after another: one scratch
                self._copy_share(0, copies, share)
        except BaseException:
            self._log_unraised(_take_errors(handed))  # never return while a helper copies
            raise
        errors = _take_errors(handed)
        if errors:
            self._log_unraised(errors[1:])
            try:
                raise errors[0]
            finally:  # the error's traceback holds this frame: no cycle through it
                del errors

    def is_own_thread(self, thread: threading.Thread) -> bool:
        """Return True if `thread` is one of the crew's helpers."""
        return any(thread is own for own in self._helpers)

    def close(self) -> None:
        """Stop the helper threads once idle (the lane's jobs are done); idempotent."""
        self._closed = True
        _stop(self._queues)
        for thread in self._helpers:
            if thread is not None:
                thread.join()

    def _hand(
        self, handed: list[Future[None]], member: int, copies: Sequence[RegionCopy], share: Share
    ) -> bool:
        """Queue `share` for member's helper, started first if need be, and add its future
        to `handed`; return False, queueing nothing, when it cannot start (a thread limit;
        Python 3.12 once the interpreter exits, where lanes still run their queued jobs):
        the caller copies it."""
        if self._helpers[member - 1] is None:
            thread = threading.Thread(
                target=_serve,
                args=(self._queues[member - 1],),
                name=f"kvtier-{self._name}-copy{member}",
                daemon=True,
            )
            try:
                thread.start()  # before the hand-off: no share is queued where none reads
            except RuntimeError:
                return False
            self._helpers[member - 1] = thread
        future: Future[None] = Future()
        scratch = self._scratch[member]  # the task holds no reference to the crew
        self._queues[member - 1].put((future, partial(_copy_share, scratch, copies, share)))
        handed.append(future)
        return True

    def _copy_share(self, member: int, copies: Sequence[RegionCopy], share: Share) -> None:
        _copy_share(self._scratch[member], copies, share)

    def _log_unraised(self, errors: Sequence[BaseException]) -> None:
        """Log, with its traceback, each error of a failed batch that `run` does not raise
        (one error is raised per batch; the lane reports only that one)."""
        for error in errors:
            logger.warning(
                "copy crew %s: another share of the failed batch failed too: %s",
                self._name,
                error,
                exc_info=error,
            )


def _copy_share(scratch: _Scratch, copies: Sequence[RegionCopy], share: Share) -> None:
    """Copy one share, with the scratch rows of the thread that runs it."""
    for item, a, b in share:
        copy = copies[item]
        rows = None
        if copy.plan.strategy is CopyStrategy.SCRATCH:
            key = (int(copy.dst.shape[1]), copy.dst.dtype)
            rows = scratch.get(key)
            if rows is None or not fits(rows, copy.dst):
                rows = scratch[key] = new_scratch(*key)
        copy_rows(copy.plan, copy.src, copy.dst, a, b, rows)


def _take_errors(handed: list[Future[None]]) -> list[BaseException]:
    """Wait for every handed share; return their errors in batch order and empty `handed`
    (the error `run` raises holds its frame, which must hold no future holding the error)."""
    errors = [future.exception() for future in handed]
    handed.clear()
    return [error for error in errors if error is not None]


def _serve(queue: SimpleQueue[_Task | None]) -> None:
    """A helper's thread: run handed shares until the `None` that stops it."""
    while (task := queue.get()) is not None:
        _settle(*task)
        del task  # keep no batch alive while waiting for the next


def _settle(future: Future[None], share: Callable[[], None]) -> None:
    try:
        share()
    except BaseException as exc:  # reported to the lane thread, which raises it
        future.set_exception(exc)
        del future, share  # the traceback holds this frame: no cycle through its future
    else:
        future.set_result(None)


def _stop(queues: Sequence[SimpleQueue[_Task | None]]) -> None:
    for queue in queues:
        queue.put(None)
