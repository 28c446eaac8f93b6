"""A transfer lane: the jobs of one direction, run in order on one background thread.

`submit` returns at once. A job is finished when its function returned (or raised) and
the device work it queued, if any, completed. `finished` reports finished jobs in
submission order and stops at the first unfinished one, so reports are FIFO per lane,
with each done job's copy time: the device time its completion measured, else the
time its function ran on the lane's thread (synchronous copies and disk I/O).

A reported job stays in the lane, and in every later `finished`, until `acknowledge`:
the caller acknowledges once it stored (or applied) the report, so a report taken by a
call that an interrupt (KeyboardInterrupt) cut short is reported again, never lost.
A job that raises is reported failed and logged; the thread lives on. Once a job ran,
the lane keeps only its outcome, and only until `acknowledge` (a failed job's error holds
the frames that ran it, and their views): an idle thread holds no job, so none of the
views of the tiers it copied between. `copy_threads` bounds the OpenMP team of the
thread's torch CPU ops (see `threads.limit_intra_op_threads`) and sizes the lane's
`crew`, the threads its CPU block copies are split over (`copy_crew`).

Each job has the lane's own future, recorded before the job is handed to the thread.
A `submit` interrupted on the way (KeyboardInterrupt) cancels that future: a job not yet
started then never runs and is reported failed, and one already running is waited for
and reported as usual. The hand-off is one `SimpleQueue.put`, a single C call an
interrupt cannot cut in half. (A `ThreadPoolExecutor` took Python-level locks in its
`submit`: a Ctrl-C landing inside one left it held, and the lane's thread, then every
later `submit`, `flush` and `shutdown`, blocked for good.)
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Literal

from kvtier.transfer.copy_crew import CopyCrew, crew_size
from kvtier.transfer.device import Completion
from kvtier.transfer.threads import limit_intra_op_threads

logger = logging.getLogger(__name__)

JobFn = Callable[[], Completion | None]


@dataclass(slots=True)
class _Ran:
    """What a job's function left: its device work (if any) and how long it ran."""

    completion: Completion | None
    seconds: float


@dataclass(slots=True)
class _Pending:
    """A submitted job not yet reported.

    `device_error`: what its completion's `wait` raised (`wait_all`). The device reported
    the job's work failed (on CUDA, as a rule, a sticky error: the context runs no more
    work), so it is reported failed at once, whatever `is_done` says later: one that
    never turns True would otherwise hold the lane's head, and every later report, for
    good.
    """

    event_id: int
    future: Future[_Ran]
    device_error: Exception | None = None
    # Set by `finished` (`error` or `seconds`, then `reported`): reported the same again.
    reported: bool = False
    seconds: float = 0.0
    error: BaseException | None = None


def _run(future: Future[_Ran], job: JobFn) -> None:
    """Run `job` on the lane's thread unless `future` was cancelled first; settle it."""
    if not future.set_running_or_notify_cancel():
        return  # cancelled before it started (see `_cancel`): reported failed
    start = time.perf_counter()
    try:
        completion = job()
    except BaseException as exc:
        future.set_exception(exc)
        # The error's traceback holds this frame: without its future, no cycle keeps the
        # job's views alive until a cyclic collection once the report is acknowledged.
        del future, job
    else:
        future.set_result(_Ran(completion, time.perf_counter() - start))


def _cancel(future: Future[_Ran]) -> None:
    """Cancel a job's future unless its job started: `_run` then never starts it.

    Only `_run` moves the future on from there (`set_running_or_notify_cancel`, once):
    notifying here too made the thread's later `_run` find it notified, which
    concurrent.futures logs as CRITICAL. `wait_all` therefore waits on each future
    (`exception()`, done once cancelled) rather than with `concurrent.futures.wait`,
    which counts a cancelled future only once notified."""
    future.cancel()


_Queue = SimpleQueue[tuple[Future[_Ran], JobFn] | None]


def _serve(jobs: _Queue, copy_threads: int | None, ready: Future[None]) -> None:
    """The lane's thread: run queued jobs in order until the `None` that closes it.

    It holds the queue, not the lane: a lane dropped unclosed is closed by its finalizer.
    """
    try:
        if copy_threads is not None:
            limit_intra_op_threads(copy_threads)
    except BaseException as exc:
        ready.set_exception(exc)
        return
    ready.set_result(None)
    while (item := jobs.get()) is not None:
        future, job = item
        try:
            _run(future, job)
        except BaseException as exc:  # `_run` settles its future; this is a safety net
            logger.exception("lane thread: a job escaped its future")
            if not future.done():
                future.set_exception(exc)
        # Idle until the next job: hold nothing of this one (its views of the tiers).
        del item, future, job


# Lanes still open at interpreter exit: their threads are daemons (a non-daemon thread
# blocked on its queue would stop the interpreter from reaching atexit), so each is
# closed here, its queued jobs finished, as ThreadPoolExecutor's threads were.
_OPEN: weakref.WeakSet[TransferLane] = weakref.WeakSet()


@atexit.register
def _close_open_lanes() -> None:
    for lane in list(_OPEN):
        lane.close()


class TransferLane:
    """Run jobs FIFO on one thread; report them FIFO. Call from one (the engine's) thread.

    `copy_threads`: OpenMP threads for torch CPU ops on the lane's thread (None keeps
    torch's process-wide setting), and the threads of its `crew` (`copy_crew.crew_size`).
    """

    def __init__(self, name: str, copy_threads: int | None = None) -> None:
        self.name = name
        self._jobs: _Queue = SimpleQueue()
        self._pending: deque[_Pending] = deque()
        self._closed = False
        self.crew = CopyCrew(crew_size(copy_threads), name)
        ready: Future[None] = Future()
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs, copy_threads, ready), name=f"kvtier-{name}"
        )
        self._thread.daemon = True
        try:
            self._thread.start()
            ready.result()
        except BaseException as exc:
            self._jobs.put(None)  # stop the thread, if it started
            self.crew.close()
            if isinstance(exc, Exception):
                raise RuntimeError(f"lane {name}: its thread failed to start ({exc})") from exc
            raise
        weakref.finalize(self, self._jobs.put, None)
        _OPEN.add(self)

    def is_own_thread(self, thread: threading.Thread) -> bool:
        """Return True if `thread` is the lane's: the one running its jobs, or a helper of
        its crew."""
        return thread is self._thread or self.crew.is_own_thread(thread)

    @property
    def num_pending(self) -> int:
        """Return the number of jobs submitted and not yet acknowledged."""
        return len(self._pending)

    def pending_event_ids(self) -> list[int]:
        """Return the event ids submitted and not yet acknowledged, oldest first."""
        return [p.event_id for p in self._pending]

    def reported_event_ids(self) -> list[int]:
        """Return the event ids `finished` reported and not yet acknowledged, oldest first."""
        return [p.event_id for p in self._pending if p.reported]

    def submit(self, event_id: int, job: JobFn) -> None:
        """Queue `job` behind the lane's earlier jobs; return at once."""
        if self._closed:
            raise RuntimeError(f"lane {self.name} is closed")
        pending = _Pending(event_id, Future())
        try:
            self._pending.append(pending)
            self._jobs.put((pending.future, job))
        except BaseException:
            _cancel(pending.future)  # no-op once the job runs: it is then waited for
            raise

    def finished(self) -> tuple[dict[int, float], dict[int, BaseException]]:
        """Return the finished jobs at the head not yet acknowledged: done event ids with
        their copy time in seconds, and failed event ids with their error; never blocks.

        Jobs an earlier call reported are reported again, the same way, until
        `acknowledge`.
        """
        done: dict[int, float] = {}
        failed: dict[int, BaseException] = {}
        for head in self._pending:
            if not head.reported:
                if not head.future.done():
                    break
                outcome = _outcome(self.name, head)
                if outcome is None:
                    break
                if outcome is True:
                    head.seconds = _seconds(head.future.result())
                else:
                    head.error = outcome
                head.reported = True  # last: an interrupt before it redoes the above
            if head.error is None:
                done[head.event_id] = head.seconds
            else:
                failed[head.event_id] = head.error
        return done, failed

    def acknowledge(self) -> None:
        """Forget the jobs `finished` reported: the caller holds their reports now.

        Each is dropped in one step, so one that an interrupt leaves is reported again."""
        pending = self._pending
        while pending and pending[0].reported:
            pending.popleft()

    def wait_all(self) -> None:
        """Block until every submitted job finished, device work included.

        Failures are not raised here; `finished` reports them, a job whose device
        work's `wait` raised included (see `_Pending.device_error`).
        """
        for pending in self._pending:
            try:
                error = pending.future.exception()  # waits until run, failed or cancelled
            except CancelledError:
                continue  # never started (see `_cancel`)
            if error is None:
                completion = pending.future.result().completion
                if completion is not None and pending.device_error is None:
                    try:
                        completion.wait()
                    except Exception as exc:  # reported (and logged) by finished
                        pending.device_error = exc

    def close(self) -> None:
        """Finish queued jobs and stop the thread; idempotent, and a call interrupted while
        waiting (KeyboardInterrupt) is finished by the next one. Unreported jobs stay
        available to `finished`."""
        self._closed = True
        self._jobs.put(None)  # behind the queued jobs; a second one is never read
        self._thread.join()
        self.crew.close()
        _OPEN.discard(self)

    def cancel_queued(self) -> None:
        """Drop the jobs not yet started and refuse new ones; never blocks. The job
        running, if any, carries on (`close` waits for it); dropped jobs report failed."""
        self._closed = True
        for pending in self._pending:  # the ones not started; the thread skips their runs
            _cancel(pending.future)
        self._jobs.put(None)


def _outcome(lane: str, pending: _Pending) -> BaseException | Literal[True] | None:
    """Return True (done), the error (failed) or None (device work still running)."""
    if pending.future.cancelled():
        logger.warning("lane %s: transfer event %d was cancelled", lane, pending.event_id)
        return CancelledError(f"transfer event {pending.event_id} was cancelled")
    error: BaseException | None = pending.future.exception()
    if error is None:
        error = pending.device_error
    if error is None:
        completion = pending.future.result().completion
        if completion is None:
            return True
        try:
            if not completion.is_done():
                return None
            return True
        except Exception as exc:
            # Kept at once: asked again (a report an interrupt cut short), the device
            # may answer done, and the copy that failed would come back done.
            pending.device_error = error = exc
    # The report names the event only: this is where its error is read. An I/O error (a
    # failing or full disk) is expected and its message says it all; anything else is a
    # bug (maybe of no message at all: a bare assert), whose type and traceback it takes.
    logger.warning(
        "lane %s: transfer event %d failed: %s",
        lane,
        pending.event_id,
        error,
        exc_info=None if isinstance(error, OSError) else error,
    )
    return error


def _seconds(ran: _Ran) -> float:
    """Return a done job's copy time: its completion's measure, else its run time (also
    when reading the measure fails: a statistic must not stall the lane's reports)."""
    try:
        measured = None if ran.completion is None else ran.completion.elapsed_s()
    except Exception as exc:
        logger.debug("copy time unavailable (%s); using the job's run time", exc)
        measured = None
    return ran.seconds if measured is None else measured
