"""`WorkerResources` with recording lanes and tiers: the order of a release, which
threads count as the worker's, and where a dropped worker is released (s33 mutation
run on `transfer/worker_resources.py`: each test failed on a mutant that passed every
older test)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

from kvtier.transfer.worker_resources import WorkerResources, release_dropped


class Lane:
    """Records its calls, and the thread each ran on."""

    def __init__(self, name: str, calls: list[tuple[str, str, str]]) -> None:
        self.name, self.calls = name, calls
        self.thread = threading.Thread(target=lambda: None)

    def _note(self, what: str) -> None:
        self.calls.append((self.name, what, threading.current_thread().name))

    def wait_all(self) -> None:
        self._note("wait_all")

    def close(self) -> None:
        self._note("close")

    def cancel_queued(self) -> None:
        self._note("cancel_queued")

    def is_own_thread(self, thread: threading.Thread) -> bool:
        return thread is self.thread


class Tier:
    """A host or disk tier that records its close; a disk tier's I/O thread."""

    def __init__(self, name: str, calls: list[tuple[str, str, str]], error: Any = None) -> None:
        self.name, self.calls, self.error = name, calls, error
        self.io_thread = threading.Thread(target=lambda: None)

    def close(self) -> None:
        self.calls.append((self.name, "close", threading.current_thread().name))
        if self.error is not None:
            raise self.error

    def is_io_thread(self, thread: threading.Thread) -> bool:
        return thread is self.io_thread


def _resources(calls: list[tuple[str, str, str]], **kwargs: Any) -> WorkerResources:
    lanes = (Lane("store", calls), Lane("load", calls))
    owner = kwargs.pop("owner", threading.current_thread())
    return WorkerResources(0, lanes, owner, **kwargs)  # type: ignore[arg-type]


def test_a_release_waits_for_every_job_then_stops_the_lanes_then_the_tiers() -> None:
    """`wait_all` comes first: on a GPU a lane's thread may be done while its device
    copies still run, and the host tier must not be unpinned under them."""
    calls: list[tuple[str, str, str]] = []
    resources = _resources(calls, host=Tier("host", calls), disk_tier=Tier("disk", calls))
    resources.release()
    assert [c[:2] for c in calls] == [
        ("store", "wait_all"),
        ("store", "close"),
        ("load", "wait_all"),
        ("load", "close"),
        ("host", "close"),
        ("disk", "close"),
    ]
    assert not resources.has_tiers


def test_the_workers_threads_are_its_lanes_and_its_disk_io_threads() -> None:
    calls: list[tuple[str, str, str]] = []
    disk = Tier("disk", calls)
    resources = _resources(calls, disk_tier=disk)
    assert all(resources.is_own_thread(lane.thread) for lane in resources.lanes)  # type: ignore[attr-defined]
    assert resources.is_own_thread(disk.io_thread)
    assert not resources.is_own_thread(threading.current_thread())


@pytest.mark.parametrize("held", ["host", "disk_tier", "pinned_staging"])
def test_each_kind_of_tier_counts_as_held(held: str) -> None:
    calls: list[tuple[str, str, str]] = []
    value: Any = [torch.zeros(4)] if held == "pinned_staging" else Tier(held, calls)
    assert _resources(calls, **{held: value}).has_tiers
    assert not _resources(calls).has_tiers


def test_only_the_errors_not_raised_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[str, str, str]] = []
    resources = _resources(
        calls,
        host=Tier("host", calls, OSError("unpin")),
        disk_tier=Tier("disk", calls, OSError("sync")),
    )
    with caplog.at_level(logging.ERROR), pytest.raises(OSError, match="unpin"):
        resources.release_tiers()
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1
    assert "sync" in logged[0]


@pytest.mark.drops_workers
def test_a_worker_dropped_on_its_owner_thread_is_released_there() -> None:
    """Inline, as `shutdown()` would: queued jobs cancelled first, nothing on a new
    thread (the owner is never one of the worker's pool threads)."""
    calls: list[tuple[str, str, str]] = []
    owner_name = "engine-owner"
    holder: list[WorkerResources] = []

    def build_and_drop() -> None:
        resources = _resources(calls, host=Tier("host", calls))
        holder.append(resources)
        release_dropped(resources)

    owner = threading.Thread(target=build_and_drop, name=owner_name)
    owner.start()
    owner.join()
    assert {c[2] for c in calls} == {owner_name}
    assert [c[:2] for c in calls][:2] == [("store", "cancel_queued"), ("load", "cancel_queued")]
    assert ("host", "close") in [c[:2] for c in calls]


@pytest.mark.drops_workers
def test_a_worker_dropped_on_the_main_thread_is_released_there() -> None:
    """At interpreter exit finalizers run on the main thread: releasing there inline,
    not on a daemon thread the exit may cut short, removes the disk tier's file."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread")
    calls: list[tuple[str, str, str]] = []
    owner = threading.Thread(target=lambda: None, name="engine-owner")
    resources = _resources(calls, owner=owner, disk_tier=Tier("disk", calls))
    release_dropped(resources)
    assert {c[2] for c in calls} == {threading.main_thread().name}
    assert ("disk", "close") in [c[:2] for c in calls]
