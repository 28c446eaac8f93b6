"""What an offload worker must give back — transfer threads, host memory, the disk tier's
file — and how: at `shutdown()`, on a retry after an interrupted shutdown, after a failed
`register()`, or from a finalizer when the worker is dropped without a shutdown.

    caller                    lanes                          tiers
    shutdown()                wait for every job, stop       close all (first error raised)
    failed register()         -                              close all (first error raised)
    finalizer, owner / main   drop queued jobs, wait, stop   close all (errors logged)
    finalizer, other thread   the same, on a new thread      (never joins its own thread)
      ... no new thread       the same inline, unless on one of the worker's threads
                              (it would wait for): then the tiers stay held, logged

The holder references no worker, so the copy threads (which hold only the holder's parts)
never keep a dropped worker alive and its finalizer does run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.storage.disk_tier import DiskTier
from kvtier.transfer.device import unpin_host_memory
from kvtier.transfer.host_tier import HostTier
from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.release_errors import error_to_raise

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerResources:
    """The threads, memory and files of one worker.

    `owner` is the thread that created the worker (the engine's); `pinned_staging` lists
    the disk tier's staging buffers page-locked for CUDA copies.
    """

    rank: int
    lanes: tuple[TransferLane, ...]
    owner: threading.Thread
    host: HostTier | None = None
    disk_tier: DiskTier | None = None
    pinned_staging: list[torch.Tensor] = field(default_factory=list)

    def is_own_thread(self, thread: threading.Thread) -> bool:
        """Return True if `release()` may wait for `thread`: a lane's, or a disk I/O one."""
        disk = self.disk_tier
        return any(lane.is_own_thread(thread) for lane in self.lanes) or (
            disk is not None and disk.is_io_thread(thread)
        )

    @property
    def has_tiers(self) -> bool:
        """Return True while a tier (or pinned staging memory) is still held."""
        return self.host is not None or self.disk_tier is not None or bool(self.pinned_staging)

    def release(self) -> None:
        """Wait for every submitted transfer, stop the lanes, then release the tiers.

        Repeatable: a call interrupted while waiting (KeyboardInterrupt) or failed leaves
        whatever it did not finish to the next call.
        """
        for lane in self.lanes:
            lane.wait_all()
            lane.close()
        self.release_tiers()

    def release_tiers(self) -> None:
        """Unpin the host tier, unpin the staging buffers, close the disk tier (which
        removes its file, or syncs a persistent one), and drop them all.

        Each tier is detached before its close runs, so it is closed at most once, and a
        close that raises does not stop the others: once all ran, the first interrupt
        (else the first error) is re-raised and the others are logged.
        """
        errors: list[BaseException] = []
        host, self.host = self.host, None
        if host is not None:
            _attempt(errors, host.close)
        while self.pinned_staging:
            _attempt(errors, unpin_host_memory, self.pinned_staging.pop())
        disk, self.disk_tier = self.disk_tier, None
        if disk is not None:
            _attempt(errors, disk.close)
        if not errors:
            return
        raised = error_to_raise(errors)
        for error in errors:
            if error is not raised:
                logger.error(
                    "offload worker rank %d: releasing a tier failed: %r", self.rank, error
                )
        raise raised


def release_dropped(resources: WorkerResources) -> None:
    """Release what a worker dropped without `shutdown()` still holds; a `weakref.finalize`
    callback, so it may run on any thread and never raises.

    Queued transfers are cancelled (nobody will poll them); the one running is waited for.
    On the worker's owner thread or the main thread (neither is ever one of the worker's
    pool threads; at interpreter exit finalizers run on the main thread) that happens
    inline, as in `shutdown()`, so the disk tier's path is free again once the worker is
    collected. Anywhere else — possibly a transfer thread that happened to run a garbage
    collection — a new thread does it, so no thread ever waits for itself. When no thread
    can start (the interpreter exiting, a thread limit) it happens inline all the same,
    except on one of the worker's own threads: there the tiers stay held (logged).
    """
    if resources.has_tiers:
        logger.warning(
            "offload worker rank %d dropped without shutdown(); releasing its tiers",
            resources.rank,
        )
    for lane in resources.lanes:
        lane.cancel_queued()
    current = threading.current_thread()
    if current is resources.owner or current is threading.main_thread():
        _release_logged(resources)  # never one of the worker's own (pool) threads
        return
    name = f"kvtier-release-rank{resources.rank}"
    thread = threading.Thread(target=_release_logged, args=(resources,), name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError as exc:  # interpreter exiting, or a thread limit
        if not resources.is_own_thread(current):
            _release_logged(resources)
            return
        logger.error(
            "offload worker rank %d dropped on its own thread %s, where no thread can start"
            " to release it (%s): its tiers stay held",
            resources.rank,
            current.name,
            exc,
        )


def _release_logged(resources: WorkerResources) -> None:
    try:
        resources.release()
    except Exception:
        logger.exception(
            "offload worker rank %d: releasing a dropped worker failed", resources.rank
        )


def _attempt(errors: list[BaseException], action: Callable[..., None], *args: object) -> None:
    try:
        action(*args)
    except BaseException as exc:  # keep releasing the other tiers, then re-raise
        errors.append(exc)
