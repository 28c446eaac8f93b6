"""`TransferPlan.forget_slots`: disk copies the scheduler dropped lose their manifest records."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_worker_persist import config, first_run, new_kv, rec, store
from transfer_helpers import make_worker, run_plan

from kvtier.offload.plan import TransferPlan

pytestmark = pytest.mark.timeout(60)


def test_forgotten_slots_are_not_recovered_and_a_rewrite_in_the_same_plan_is(
    tmp_path: Path,
) -> None:
    """The records go before the plan's jobs run: a slot the same plan writes again keeps
    its new record. `forget_slots` (no plan, e.g. at shutdown) drops them at once."""
    first_run(tmp_path)  # records of slots 3, 5, 7, 9
    with make_worker(config(tmp_path), new_kv(seed=2)) as worker:
        plan = TransferPlan(step_id=1, jobs=(store(1, [1], [7]),), forget_slots=(3, 7))
        worker.submit(plan)
        worker.flush()
        assert dict(worker.poll().done) == {1: 1}
        assert worker.recovered_slots() == [(5, rec(5)), (9, rec(9))]
        worker.forget_slots([9])
        assert worker.recovered_slots() == [(5, rec(5))]
        with pytest.raises(ValueError, match="outside"):
            worker.forget_slots([16])
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:
        assert worker.recovered_slots() == [(5, rec(5)), (7, rec(7))]


def test_a_non_persistent_tier_ignores_forgotten_slots(tmp_path: Path) -> None:
    with make_worker(config(tmp_path, disk_persist=False), new_kv(seed=2)) as worker:
        worker.submit(TransferPlan(step_id=1, forget_slots=(3,)))
        worker.forget_slots([4])
        assert worker.recovered_slots() == []


def test_a_store_over_recorded_slots_syncs_their_tombstones_once_per_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job reusing recorded slots (their blocks evicted) drops their records, durably,
    before its first batch is written: one manifest sync for the job, not one per batch
    (4 KiB slots, 2 per batch: 3 batches here). The restart finds the new records."""
    first_run(tmp_path)  # records of slots 3, 5, 7, 9
    with make_worker(config(tmp_path, disk_batch_bytes=2 * 4096), new_kv(seed=2)) as worker:
        real_fsync = os.fsync
        manifest_syncs: list[int] = []

        def fsync(fd: int) -> None:
            real_fsync(fd)
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".manifest"):
                manifest_syncs.append(fd)

        with monkeypatch.context() as patch:
            patch.setattr(os, "fsync", fsync)
            done = run_plan(worker, store(1, [1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 9])).done
        assert dict(done) == {1: 1}
        assert len(manifest_syncs) == 1, manifest_syncs
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:
        assert [slot for slot, _ in worker.recovered_slots()] == [3, 4, 5, 6, 7, 9]
