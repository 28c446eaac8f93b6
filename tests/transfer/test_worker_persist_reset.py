"""`TransferPlan.end_persistence` (every plan after a tier reset): the worker drops its
persistent disk tier's records before the plan's jobs and records nothing more."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_worker_persist import config, first_run, new_kv, paths, store
from transfer_helpers import block_bytes, job, make_worker, run_plan

from kvtier.offload.plan import Tier, TransferPlan
from kvtier.transfer import OffloadWorker
from kvtier.transfer.regions import TensorLayout

pytestmark = pytest.mark.timeout(60)


def ending(*jobs: object, step_id: int = 0) -> TransferPlan:
    return TransferPlan(step_id=step_id, jobs=jobs, end_persistence=True)  # type: ignore[arg-type]


def restorable(directory: Path, rank: int = 0) -> list[int]:
    """Return the slots a restart would restore if the process died now: the worker's
    files, copied as they are (the original slot file stays locked), opened afresh."""
    copy = directory / f"crash-copy-{rank}"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir()
    for name in (f"kvtier-rank{rank}.slots", f"kvtier-rank{rank}.manifest"):
        if (directory / name).exists():
            shutil.copy2(directory / name, copy / name)
    with make_worker(config(copy, rank=rank), new_kv(seed=9)) as worker:
        return [slot for slot, _ in worker.recovered_slots()]


def test_the_flag_drops_every_record_and_later_stores_are_not_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first_run(tmp_path)
    kv = new_kv(seed=2)
    with make_worker(config(tmp_path), kv) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [3, 5, 7, 9]
        with caplog.at_level(logging.INFO, logger="kvtier"):
            worker.submit(ending(store(1, [1, 2], [11, 12])))
        assert "a reset dropped the persistent cache" in caplog.text
        assert worker.recovered_slots() == []
        worker.flush()
        assert dict(worker.poll().done) == {1: 1}
        assert restorable(tmp_path) == []  # a crash here restores nothing
        run_plan(worker, job(2, Tier.GPU, Tier.CPU, [3], [0]))
        assert dict(run_plan(worker, store(3, [0], [13], tier=Tier.CPU)).done) == {3: 1}
        assert restorable(tmp_path) == []
        # The tier still serves this run's stores.
        want = block_bytes(worker.regions, 2)
        assert dict(run_plan(worker, job(4, Tier.DISK, Tier.GPU, [12], [20])).done) == {4: 1}
        assert block_bytes(worker.regions, 20) == want
        worker.check_invariants()
    assert all(p.exists() for p in paths(tmp_path))
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:
        assert worker.recovered_slots() == []


def test_a_store_in_flight_at_the_flag_is_not_recorded(tmp_path: Path) -> None:
    """Stores issued before the reset that complete after the flag (or before it) leave
    no record."""
    with make_worker(config(tmp_path), new_kv(seed=1)) as worker:
        for event in range(1, 9, 2):
            worker.submit(TransferPlan(0, (store(event, [event], [event]),)))
            worker.submit(ending(step_id=1))  # the lane may be mid-write
            worker.submit(ending(store(event + 1, [event + 1], [event + 1])))
        worker.flush()
        report = worker.poll()
        assert sorted(report.done) == list(range(1, 9))
        assert restorable(tmp_path) == []
    with make_worker(config(tmp_path), new_kv(seed=2)) as worker:
        assert worker.recovered_slots() == []


def test_every_rank_applies_it(tmp_path: Path) -> None:
    for rank in (0, 1):
        first_run(tmp_path, rank=rank)
    workers = [make_worker(config(tmp_path, rank=rank), new_kv(seed=2)) for rank in (0, 1)]
    try:
        plan = ending(store(1, [1], [11]))
        for worker in workers:  # the same plan to each rank, as a connector sends it
            assert worker.recovered_slots()
            worker.submit(plan)
            worker.flush()
            assert dict(worker.poll().done) == {1: 1}
        assert restorable(tmp_path, 0) == restorable(tmp_path, 1) == []
    finally:
        for worker in workers:
            worker.shutdown()
    for rank in (0, 1):
        with make_worker(config(tmp_path, rank=rank), new_kv(seed=3)) as worker:
            assert worker.recovered_slots() == []


def test_a_plan_without_the_flag_leaves_the_records(tmp_path: Path) -> None:
    first_run(tmp_path)
    with make_worker(config(tmp_path), new_kv(seed=2)) as worker:
        run_plan(worker, store(1, [1], [11]))
        assert restorable(tmp_path) == [3, 5, 7, 9, 11]
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [3, 5, 7, 9, 11]
        with pytest.raises(ValueError, match="end_persistence must be a bool"):
            worker.submit(TransferPlan(0, end_persistence=1))  # type: ignore[arg-type]


CRASHING = """
import os, sys
from test_worker_persist import config, new_kv, store
from transfer_helpers import make_worker
from kvtier.offload.plan import TransferPlan
worker = make_worker(config(sys.argv[1]), new_kv(seed=2))
assert worker.recovered_slots()
worker.submit(TransferPlan(0, (store(1, [1, 2], [11, 12]),), end_persistence=True))
worker.flush()
os._exit(0)  # killed before shutdown: nothing is synced or closed
"""


def test_a_process_that_dies_after_the_flag_leaves_nothing_to_restore(tmp_path: Path) -> None:
    first_run(tmp_path)
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    subprocess.run([sys.executable, "-c", CRASHING, str(tmp_path)], check=True, env=env, timeout=50)
    with OffloadWorker(config(tmp_path)) as worker:
        worker.register(new_kv(seed=3), TensorLayout.KV_FIRST)
        assert worker.recovered_slots() == []
