"""Which jobs wait for the engine's compute-done marker (SPEC §7 ordering), on the CPU.

A store reads GPU blocks the forward pass writes, so it waits for the compute queued
before it. A load does not: the engine hands it blocks no queued forward writes (see the
worker's module docstring). CPU ↔ disk jobs touch no GPU memory. The marker itself is a
CUDA event; here a sentinel stands in for it and the copies run on the CPU.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transfer_helpers import job, kv_per_layer, make_worker, run_plan

from kvtier.offload.plan import Tier, TransferPlan
from kvtier.transfer import WorkerConfig
from kvtier.transfer import worker as worker_module
from kvtier.transfer.routes import Route, Task

MARKER = object()


def test_stores_from_gpu_blocks_wait_for_the_compute_marker_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC scenario 30: stores out of GPU blocks (to CPU and to disk) get the step's
    compute-done marker; loads and CPU ↔ disk moves do not."""
    kv = kv_per_layer(2, 8)
    config = WorkerConfig(cpu_num_slots=8, disk_num_slots=8, disk_path=str(tmp_path))
    with make_worker(config, kv) as worker:
        asked: list[bool] = []

        def take_marker(needed: bool, recorded: object | None) -> object | None:
            asked.append(needed)
            return MARKER if needed else None

        markers: dict[Route, object | None] = {}
        real_run_task = worker_module.run_task

        def spy(task: Task, *args: object) -> object:
            markers[task.route] = task.marker
            return real_run_task(dataclasses.replace(task, marker=None), *args)  # type: ignore[arg-type]

        monkeypatch.setattr(worker, "_compute_marker_for", take_marker)
        monkeypatch.setattr(worker_module, "run_task", spy)
        run_plan(
            worker, job(1, Tier.GPU, Tier.CPU, [1], [0]), job(2, Tier.GPU, Tier.DISK, [2], [0])
        )
        run_plan(worker, job(3, Tier.CPU, Tier.GPU, [0], [3]))
        run_plan(worker, job(4, Tier.DISK, Tier.GPU, [0], [4]))
        run_plan(
            worker, job(5, Tier.CPU, Tier.DISK, [0], [1]), job(6, Tier.DISK, Tier.CPU, [0], [2])
        )
    assert asked == [True, False, False, False]
    assert markers == {
        Route.HOST_STORE: MARKER,
        Route.DISK_STORE: MARKER,
        Route.HOST_LOAD: None,
        Route.DISK_LOAD: None,
        Route.DEMOTE: None,
        Route.PROMOTE: None,
    }


@pytest.mark.parametrize("failure", ["bad job", "end_persistence"])
def test_a_failed_submit_uses_up_the_recorded_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Regression: a submit failing before it took the marker `record_compute_done()` left
    kept it, so the next submit's stores waited on that stale marker (an earlier forward
    pass) instead of recording one for its own step."""
    kv = kv_per_layer(2, 8)
    with make_worker(WorkerConfig(cpu_num_slots=8), kv) as worker:
        markers: list[object | None] = []
        real_run_task = worker_module.run_task

        def spy(task: Task, *args: object) -> object:
            markers.append(task.marker)
            return real_run_task(dataclasses.replace(task, marker=None), *args)  # type: ignore[arg-type]

        monkeypatch.setattr(worker_module, "run_task", spy)
        worker._compute_marker = MARKER  # what record_compute_done() leaves on CUDA
        if failure == "bad job":
            with pytest.raises(ValueError, match="event 1"):
                run_plan(worker, job(1, Tier.GPU, Tier.CPU, [99], [0]))
        else:
            with monkeypatch.context() as patch:
                patch.setattr(worker, "end_persistence", fail_end_persistence)
                with pytest.raises(OSError, match="manifest"):
                    worker.submit(TransferPlan(step_id=1, end_persistence=True))
        run_plan(worker, job(2, Tier.GPU, Tier.CPU, [1], [0]))
    assert markers == [None]  # on the CPU, no marker but a recorded one


def fail_end_persistence() -> None:
    raise OSError("cannot rewrite the manifest")
