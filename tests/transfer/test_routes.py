"""Which copier, which copy direction and which tensors each route hands a job to.

On a CPU-only machine the worker's two copiers of a lane are one object and a CPU copy
is the same call whichever way it runs, so the end-to-end tests cannot see a route that
copies through the wrong copier or calls `store` for a load: on a GPU those are the
CUDA copier's device-side gather for host rows (or the reverse), which copies the wrong
bytes. Distinct recording copiers pin the route table here.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.transfer.disk_mover import PartlyLoadedError
from kvtier.transfer.routes import LaneCopiers, Route, Task, run_task

pytestmark = pytest.mark.timeout(30)

ENGINE = ["engine-regions"]
HOST = ["host-regions"]
SRC = np.array([3, 1])
DST = np.array([0, 5])
RECORDS = (SlotRecord(b"k0", 16), SlotRecord(b"k1", 16))


def _ids(ids: np.ndarray) -> tuple[int, ...]:
    return tuple(ids.tolist())


class RecordingCopier:
    """A `BlockCopier` that records its calls instead of copying."""

    def __init__(self, name: str, calls: list[tuple[Any, ...]]) -> None:
        self.name = name
        self.calls = calls

    def wait_for_compute(self, marker: object) -> None:
        self.calls.append((self.name, "wait_for_compute", marker))

    def begin(self) -> None:
        self.calls.append((self.name, "begin"))

    def store(self, src: Any, src_ids: Any, dst: Any, dst_ids: Any) -> None:
        self.calls.append((self.name, "store", src, _ids(src_ids), dst, _ids(dst_ids)))

    def load(self, src: Any, src_ids: Any, dst: Any, dst_ids: Any) -> None:
        self.calls.append((self.name, "load", src, _ids(src_ids), dst, _ids(dst_ids)))

    def finish(self) -> None:
        self.calls.append((self.name, "finish"))


class RecordingDisk:
    """A `DiskMover` that records which copier and tensors each call got."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def store(self, copier: Any, src: Any, src_ids: Any, slot_ids: Any, records: Any) -> None:
        self.calls.append(("disk.store", copier.name, src, _ids(src_ids), _ids(slot_ids), records))

    def load(self, copier: Any, slot_ids: Any, dst: Any, dst_ids: Any) -> None:
        self.calls.append(("disk.load", copier.name, _ids(slot_ids), dst, _ids(dst_ids)))


def _run(route: Route, records: tuple[SlotRecord, ...] | None = None) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    copiers = LaneCopiers(RecordingCopier("engine", calls), RecordingCopier("host", calls))  # type: ignore[arg-type]
    task = Task(route, SRC, DST, None, records)
    run_task(task, copiers, ENGINE, HOST, RecordingDisk(calls))  # type: ignore[arg-type]
    return [call for call in calls if call[1] != "wait_for_compute"]


def test_host_routes_copy_through_the_engine_copier_in_their_direction() -> None:
    s, d = _ids(SRC), _ids(DST)
    assert _run(Route.HOST_STORE) == [
        ("engine", "begin"),
        ("engine", "store", ENGINE, s, HOST, d),
        ("engine", "finish"),
    ]
    assert _run(Route.HOST_LOAD) == [
        ("engine", "begin"),
        ("engine", "load", HOST, s, ENGINE, d),
        ("engine", "finish"),
    ]


def test_disk_routes_stage_through_the_copier_of_their_other_tier() -> None:
    s, d = _ids(SRC), _ids(DST)
    assert _run(Route.DISK_STORE, RECORDS) == [("disk.store", "engine", ENGINE, s, d, RECORDS)]
    assert _run(Route.DISK_LOAD) == [("disk.load", "engine", s, ENGINE, d)]
    assert _run(Route.DEMOTE, RECORDS) == [("disk.store", "host", HOST, s, d, RECORDS)]
    assert _run(Route.PROMOTE) == [("disk.load", "host", s, HOST, d)]


class Marker:
    """A compute-done event that records its host-side wait."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def synchronize(self) -> None:
        self.calls.append(("marker", "synchronize"))


@pytest.mark.parametrize("route", list(Route))
def test_every_route_first_waits_for_the_forward_pass(route: Route) -> None:
    """Before any copy, the engine copier waits on the job's compute-done marker (on a
    GPU, a store issued before it would read blocks the forward pass is still writing);
    a disk route also waits for it on the lane thread, so that its timing starts after."""
    calls: list[tuple[Any, ...]] = []
    copiers = LaneCopiers(RecordingCopier("engine", calls), RecordingCopier("host", calls))  # type: ignore[arg-type]
    marker = Marker(calls)
    run_task(Task(route, SRC, DST, marker), copiers, ENGINE, HOST, RecordingDisk(calls))  # type: ignore[arg-type]
    assert calls[0] == ("engine", "wait_for_compute", marker)
    waits = [call for call in calls if call == ("marker", "synchronize")]
    on_disk = route not in (Route.HOST_STORE, Route.HOST_LOAD)
    assert waits == ([("marker", "synchronize")] if on_disk else [])
    if on_disk:
        assert calls[1] == ("marker", "synchronize")


@pytest.mark.parametrize("route", list(Route))
def test_an_empty_job_copies_nothing(route: Route) -> None:
    calls: list[tuple[Any, ...]] = []
    copiers = LaneCopiers(RecordingCopier("engine", calls), RecordingCopier("host", calls))  # type: ignore[arg-type]
    empty = np.array([], dtype=np.int64)
    task = Task(route, empty, empty, Marker(calls))
    assert run_task(task, copiers, ENGINE, HOST, RecordingDisk(calls)) is None  # type: ignore[arg-type]
    assert calls == []


class SlowDisk(RecordingDisk):
    """A disk mover whose calls take `seconds`; loads fail part-way when told to."""

    def __init__(self, calls: list[tuple[Any, ...]], seconds: float, fail: bool) -> None:
        super().__init__(calls)
        self.seconds, self.fail = seconds, fail

    def store(self, copier: Any, src: Any, src_ids: Any, slot_ids: Any, records: Any) -> None:
        time.sleep(self.seconds)

    def load(self, copier: Any, slot_ids: Any, dst: Any, dst_ids: Any) -> None:
        time.sleep(self.seconds)
        if self.fail:
            raise PartlyLoadedError({5}, "slot 5 is bad", "/tier/slots", None)


@pytest.mark.parametrize("route", [Route.DISK_STORE, Route.DISK_LOAD, Route.DEMOTE, Route.PROMOTE])
def test_a_disk_job_is_timed_on_its_lane(route: Route) -> None:
    """A disk job's completion carries the seconds its staging copies and I/O took."""
    calls: list[tuple[Any, ...]] = []
    copiers = LaneCopiers(RecordingCopier("engine", calls), RecordingCopier("host", calls))  # type: ignore[arg-type]
    disk = SlowDisk(calls, 0.05, fail=False)
    done = run_task(Task(route, SRC, DST, None, RECORDS), copiers, ENGINE, HOST, disk)  # type: ignore[arg-type]
    assert done is not None
    assert done.is_done()
    assert 0.05 <= done.elapsed_s() < 5


@pytest.mark.parametrize("route", [Route.DISK_LOAD, Route.PROMOTE])
def test_a_partly_failed_load_is_timed_too(route: Route) -> None:
    """A load whose good blocks were copied before a bad slot raised carries the time
    they took (they count in the load's throughput)."""
    calls: list[tuple[Any, ...]] = []
    copiers = LaneCopiers(RecordingCopier("engine", calls), RecordingCopier("host", calls))  # type: ignore[arg-type]
    disk = SlowDisk(calls, 0.05, fail=True)
    with pytest.raises(PartlyLoadedError) as caught:
        run_task(Task(route, SRC, DST, None), copiers, ENGINE, HOST, disk)  # type: ignore[arg-type]
    assert caught.value.seconds is not None
    assert 0.05 <= caught.value.seconds < 5
