"""A persistent disk tier's failed writes: the next plan drops their slots' records.

A job that failed on one worker may have been written (and recorded) by another, so the
slots of every failed store or demotion into the disk tier go into the next plan's
`forget_slots`, which no plan carries without `disk_persist` or after a reset.
"""

from __future__ import annotations

import pytest
from sim import SimEngine, full_layout, make_request
from test_scenarios_cascade import cascade_engine

from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier, TransferPlan


def disk_only(persist: bool) -> SimEngine:
    config = OffloadConfig(
        disk_bytes=1 << 20,
        disk_path="unused-by-the-fake-worker",
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=persist,
    )
    return SimEngine(full_layout(), config, num_gpu_blocks=16, num_tier_blocks=9)


def run_failing_disk(engine: SimEngine, num_requests: int) -> tuple[set[int], set[int]]:
    """Run requests whose every write into the disk tier fails; return the failed jobs'
    disk slots and the slots the plans named in `forget_slots`."""
    engine.auto_complete = False
    failed: set[int] = set()
    forgotten: set[int] = set()

    def step() -> TransferPlan:
        plan = engine.step()
        forgotten.update(plan.forget_slots)
        for job in plan.jobs:
            if job.dst_tier is Tier.DISK:
                engine.worker.fail(job.event_id)
                failed.update(job.dst_block_ids)
            else:
                engine.worker.complete(job.event_id)
        engine.poll()
        return plan

    for i in range(num_requests):
        request = make_request(f"r{i}", range(100 * i, 100 * i + 8))
        assert engine.admit(request) is not None
        engine.schedule(request.request_id)
        step()
        engine.finish(request.request_id)
        for _ in range(3):
            step()
    return failed, forgotten


@pytest.mark.parametrize("persist", [False, True], ids=["kept", "persistent"])
@pytest.mark.parametrize("cascade", [False, True], ids=["disk", "cpu+disk"])
def test_failed_disk_writes_are_named_by_the_next_plan(persist: bool, cascade: bool) -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, disk_persist=persist) if cascade else None
    engine = engine or disk_only(persist)
    failed, forgotten = run_failing_disk(engine, 3)
    assert failed
    assert forgotten == (failed if persist else set())
    engine.check()


def test_a_reset_stops_naming_slots() -> None:
    engine = disk_only(persist=True)
    engine.scheduler.reset()
    failed, forgotten = run_failing_disk(engine, 2)
    assert failed
    assert not forgotten
