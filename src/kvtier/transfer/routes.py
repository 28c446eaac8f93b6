"""The offload worker's routes: the tier pairs a job may move between, the lane direction
that runs each, and the copies that execute one validated job on its lane thread.

The route table and the ordering rules are described in `worker`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.offload.plan import SlotRecord, Tier
from kvtier.transfer.copiers import BlockCopier
from kvtier.transfer.device import Completion
from kvtier.transfer.disk_mover import DiskMover, PartlyLoadedError

__all__ = ["ROUTES", "STORE_ROUTES", "Direction", "LaneCopiers", "Route", "Task", "run_task"]


class Route(enum.Enum):
    """What a job moves, by its source and destination tier."""

    HOST_STORE = "host_store"
    HOST_LOAD = "host_load"
    DISK_STORE = "disk_store"
    DISK_LOAD = "disk_load"
    DEMOTE = "demote"
    PROMOTE = "promote"


ROUTES = {
    (Tier.GPU, Tier.CPU): Route.HOST_STORE,
    (Tier.CPU, Tier.GPU): Route.HOST_LOAD,
    (Tier.GPU, Tier.DISK): Route.DISK_STORE,
    (Tier.DISK, Tier.GPU): Route.DISK_LOAD,
    (Tier.CPU, Tier.DISK): Route.DEMOTE,
    (Tier.DISK, Tier.CPU): Route.PROMOTE,
}


class Direction(enum.Enum):
    """A lane of the worker: the jobs of one direction run on one thread, in order."""

    STORE = "store"  # down the tiers
    LOAD = "load"  # up the tiers


STORE_ROUTES = frozenset({Route.HOST_STORE, Route.DISK_STORE, Route.DEMOTE})


@dataclass(frozen=True)
class Task:
    """One validated job, ready for a lane."""

    route: Route
    src_ids: np.ndarray
    dst_ids: np.ndarray
    marker: torch.cuda.Event | None
    records: tuple[SlotRecord, ...] | None = None  # for a persistent disk tier's manifest


@dataclass(frozen=True)
class LaneCopiers:
    """The copiers of one lane."""

    engine: BlockCopier  # engine regions ↔ host memory
    host: BlockCopier  # host tier ↔ disk staging (always CPU)


def run_task(
    task: Task,
    copiers: LaneCopiers,
    engine: Sequence[torch.Tensor],
    host: Sequence[torch.Tensor],
    disk: DiskMover | None,
) -> Completion | None:
    """Execute one task on its lane thread; raise on failure.

    `engine` and `host` are the engine's and the host tier's regions as rows of the row
    dtype; `disk` moves blocks to and from the disk tier (None without one).
    """
    if len(task.src_ids) == 0:
        return None
    route, src, dst = task.route, task.src_ids, task.dst_ids
    copiers.engine.wait_for_compute(task.marker)
    if route is Route.HOST_STORE:
        copiers.engine.begin()
        copiers.engine.store(engine, src, host, dst)
        return copiers.engine.finish()
    if route is Route.HOST_LOAD:
        copiers.engine.begin()
        copiers.engine.load(host, src, engine, dst)
        return copiers.engine.finish()
    assert disk is not None
    if task.marker is not None:
        # Wait for the forward pass here, not inside the first staging copy, so that the
        # job's time (from here on) is its copy and I/O only.
        task.marker.synchronize()
    start = time.perf_counter()
    try:
        if route is Route.DISK_STORE:
            disk.store(copiers.engine, engine, src, dst, task.records)
        elif route is Route.DISK_LOAD:
            disk.load(copiers.engine, src, engine, dst)
        elif route is Route.DEMOTE:
            disk.store(copiers.host, host, src, dst, task.records)
        else:
            disk.load(copiers.host, src, host, dst)
    except PartlyLoadedError as exc:  # its good blocks were copied: their time counts
        exc.seconds = time.perf_counter() - start
        raise
    return Finished(time.perf_counter() - start)


class Finished:
    """The `Completion` of a job that finished on its lane thread, timed there."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def is_done(self) -> bool:
        """Return True: nothing is left running."""
        return True

    def wait(self) -> None:
        """Return at once."""

    def elapsed_s(self) -> float:
        """Return the seconds the job's copies and I/O took."""
        return self._seconds
