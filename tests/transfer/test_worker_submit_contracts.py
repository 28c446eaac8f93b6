"""The worker's submit and shutdown at their edges: which lane and marker each job
gets, the in-flight set after an interrupted submit, a persistent tier's region names,
the tier memory freed at shutdown (s33 mutation run on `transfer/worker.py`: each test
failed on a mutant that passed every older test)."""

from __future__ import annotations

import dataclasses
import gc
import threading
from pathlib import Path

import pytest
import torch
from transfer_helpers import fill_random, job, kv_per_layer, make_worker, run_plan

from kvtier.core.keys import make_key
from kvtier.offload.plan import SlotRecord, Tier, TransferJob, TransferPlan
from kvtier.storage import DiskIOMode
from kvtier.transfer import OffloadWorker, WorkerConfig
from kvtier.transfer import worker as worker_module
from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.regions import TensorLayout
from kvtier.transfer.routes import Route, Task

pytestmark = pytest.mark.timeout(60)

MARKER = object()


def test_in_a_mixed_plan_only_the_stores_out_of_gpu_blocks_get_the_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC scenario 30 within one plan: the GPU store waits for the compute marker; the
    plan's CPU -> disk demotion and CPU -> GPU load beside it do not."""
    config = WorkerConfig(cpu_num_slots=8, disk_num_slots=8, disk_path=str(tmp_path))
    markers: dict[Route, object | None] = {}
    real_run_task = worker_module.run_task

    def spy(task: Task, *args: object) -> object:
        markers[task.route] = task.marker
        return real_run_task(dataclasses.replace(task, marker=None), *args)  # type: ignore[arg-type]

    with make_worker(config, kv_per_layer(2, 8)) as worker:
        monkeypatch.setattr(worker, "_compute_marker_for", lambda needed, recorded: MARKER)
        monkeypatch.setattr(worker_module, "run_task", spy)
        run_plan(
            worker,
            job(1, Tier.GPU, Tier.CPU, [1], [0]),
            job(2, Tier.CPU, Tier.DISK, [3], [1]),
            job(3, Tier.CPU, Tier.GPU, [4], [5]),
        )
    assert markers == {Route.HOST_STORE: MARKER, Route.DEMOTE: None, Route.HOST_LOAD: None}


def test_loads_run_on_the_load_lane_and_stores_on_the_store_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One lane a direction: a load never queues behind the stores of earlier steps."""
    config = WorkerConfig(cpu_num_slots=8, disk_num_slots=8, disk_path=str(tmp_path))
    threads: dict[Route, str] = {}
    real_run_task = worker_module.run_task

    def spy(task: Task, *args: object) -> object:
        threads[task.route] = threading.current_thread().name
        return real_run_task(task, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(worker_module, "run_task", spy)
    with make_worker(config, kv_per_layer(2, 8)) as worker:
        run_plan(
            worker,
            job(1, Tier.GPU, Tier.CPU, [1], [0]),
            job(2, Tier.GPU, Tier.DISK, [2], [0]),
            job(3, Tier.CPU, Tier.DISK, [3], [1]),
        )
        run_plan(
            worker,
            job(4, Tier.CPU, Tier.GPU, [0], [4]),
            job(5, Tier.DISK, Tier.GPU, [0], [5]),
            job(6, Tier.DISK, Tier.CPU, [1], [2]),
        )
    stores = {Route.HOST_STORE, Route.DISK_STORE, Route.DEMOTE}
    assert {threads[r] for r in stores} == {"kvtier-store"}
    assert {threads[r] for r in set(Route) - stores} == {"kvtier-load"}


def test_a_submit_interrupted_after_its_lane_took_the_job_keeps_it_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C right after the lane queued the job: the event stays in flight (it will
    be reported), and the invariants hold."""
    real_submit = TransferLane.submit

    def submit_then_interrupt(self: TransferLane, event_id: int, run: object) -> None:
        real_submit(self, event_id, run)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    with make_worker(WorkerConfig(cpu_num_slots=8), kv_per_layer(2, 8)) as worker:
        monkeypatch.setattr(TransferLane, "submit", submit_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            worker.submit(TransferPlan(0, jobs=(job(1, Tier.GPU, Tier.CPU, [1], [0]),)))
        monkeypatch.undo()
        worker.check_invariants()
        worker.flush()
        assert worker.poll().done == {1: 1}
        worker.check_invariants()


def _persistent(directory: Path) -> WorkerConfig:
    return WorkerConfig(
        cpu_num_slots=4,
        disk_num_slots=8,
        disk_path=str(directory),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=True,
        disk_fingerprint="tiny|kv|seed 0",
    )


def _register(config: WorkerConfig, names: tuple[str, str]) -> OffloadWorker:
    kv = kv_per_layer(2, 16, (16, 2, 16))
    fill_random(kv, seed=4)
    worker = OffloadWorker(config)
    worker.register(dict(zip(names, kv, strict=True)), TensorLayout.KV_FIRST)
    return worker


def test_a_persistent_tier_of_other_region_names_starts_fresh(tmp_path: Path) -> None:
    """The same block sizes under other layer names (an engine that lists its layers in
    another order) put other bytes at each offset of a slot: the old slots are not
    offered again, or a restart would load layer 1's KV into layer 0."""
    record = SlotRecord(make_key(b"\x07" * 32, 0), 16)
    with _register(_persistent(tmp_path), ("layer.0", "layer.1")) as worker:
        stored = TransferJob(1, Tier.GPU, Tier.DISK, (3,), (2,), (record,))
        assert run_plan(worker, stored).done == {1: 1}
    with _register(_persistent(tmp_path), ("layer.0", "layer.1")) as worker:
        assert worker.recovered_slots() == [(2, record)]
    with _register(_persistent(tmp_path), ("layer.1", "layer.0")) as worker:
        assert worker.recovered_slots() == []


def test_shutdown_lets_go_of_the_tier_memory() -> None:
    """After shutdown the worker holds no view of its host tier: the memory is freed
    once the caller drops its own references, not when the worker goes."""
    worker = make_worker(WorkerConfig(cpu_num_slots=8), kv_per_layer(2, 8))
    host = worker.host_tier
    assert host is not None
    address = host.views[0].untyped_storage().data_ptr()
    del host
    worker.shutdown()
    gc.collect()
    assert worker.host_tier is None
    still_viewed = [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, torch.Tensor) and obj.untyped_storage().data_ptr() == address
    ]
    assert still_viewed == []
