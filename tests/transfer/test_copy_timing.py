"""Copy times the worker reports (SPEC §6.10 Beyond: transfer time per direction)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.transfer import routes
from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.routes import LaneCopiers, Route, Task, run_task

pytestmark = pytest.mark.timeout(60)
FORWARD_S = 0.3


class Marker:
    """A compute-done event whose forward pass ends when `done` is set (CUDA's Event API).

    `now` is a clock that moves only while the pass runs: `FORWARD_S` in the first wait,
    which waits for its end (later waits find it over). Timed by it, a copy's time is the
    same on a loaded machine, where a thread may wait any time for a core."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.now = 0.0
        self.passed = False

    def synchronize(self) -> None:
        assert self.done.wait(10)
        if not self.passed:
            self.passed = True
            self.now += FORWARD_S


class StagingCopier:
    """Models CudaCopier: a staging copy returns only once the compute wait is satisfied."""

    def __init__(self) -> None:
        self.marker: Marker | None = None

    def wait_for_compute(self, marker: Marker | None) -> None:
        self.marker = marker

    def store_to_staging(self, *args: Any) -> None:
        if self.marker is not None:
            self.marker.synchronize()


class FakeDisk:
    def store(self, copier: StagingCopier, *args: Any) -> None:
        copier.store_to_staging()


def test_a_disk_store_is_timed_from_the_end_of_the_forward_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU → disk job waits for the step's forward pass first; that wait is not copy time."""
    marker = Marker()
    monkeypatch.setattr(routes, "time", SimpleNamespace(perf_counter=lambda: marker.now))
    copier = StagingCopier()
    task = Task(Route.DISK_STORE, np.array([1]), np.array([1]), marker)  # type: ignore[arg-type]
    lane = TransferLane("store")
    copiers = LaneCopiers(copier, copier)  # type: ignore[arg-type]
    lane.submit(7, lambda: run_task(task, copiers, [], [], FakeDisk()))  # type: ignore[arg-type]
    threading.Timer(FORWARD_S, marker.done.set).start()
    lane.wait_all()
    done, failed = lane.finished()
    lane.acknowledge()
    lane.close()
    assert list(failed) == []
    assert done[7] == 0, f"{done[7]:.3f} s includes the {FORWARD_S} s forward pass"


class BrokenTiming:
    """A completion whose time cannot be read (a device error surfacing there)."""

    def is_done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def elapsed_s(self) -> float:
        raise RuntimeError("CUDA error: timing unavailable")


def test_a_copy_time_that_cannot_be_read_does_not_stall_the_lane() -> None:
    lane = TransferLane("test")
    lane.submit(1, BrokenTiming)  # type: ignore[arg-type]
    lane.submit(2, lambda: None)
    lane.wait_all()
    done, failed = lane.finished()
    lane.acknowledge()
    lane.close()
    assert (list(done), list(failed)) == ([1, 2], [])
    assert done[1] >= 0  # the job's run time stands in
