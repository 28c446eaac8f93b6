"""A reset while disk slots given back on trial are being written (a disk-only tier).

The reset gives every held slot back and forgets the trials; the abandoned store that
wrote into trial slots then frees them, failed or not, and the disk ends all free.
"""

from __future__ import annotations

import pytest
from sim import make_request
from test_disk_only_failing_slots import BadDisk, disk_engine, held
from test_scenarios_cascade import next_job

from kvtier.offload.config import StoreMode
from kvtier.offload.plan import Tier


@pytest.mark.parametrize("mode", [StoreMode.EAGER, StoreMode.LAZY])
@pytest.mark.parametrize("fails", [False, True])
def test_a_reset_while_trial_slots_are_written_leaves_the_disk_all_free(
    mode: StoreMode, fails: bool
) -> None:
    engine = disk_engine(9, store_mode=mode)  # 8 usable disk slots
    disk = BadDisk(engine, set(range(1, 9)))
    disk.run("r0", 0)  # its store fails: its slots are held
    suspects = set(held(engine).held())
    assert suspects
    disk.bad = set()
    held(engine).note_succeeded([])  # as after any successful store: back on trial
    assert held(engine).on_trial == suspects
    request = make_request("r2", range(200, 208))
    assert engine.admit(request) is not None
    engine.schedule("r2")
    jobs = [job for job in engine.step().jobs if job.dst_tier is Tier.DISK]  # eager
    engine.finish("r2")
    job = jobs[0] if jobs else next_job(engine, Tier.GPU, Tier.DISK)  # lazy
    assert suspects & set(job.dst_block_ids)  # a trial slot is being written
    assert not engine.scheduler.reset()  # pending: the store is in flight
    assert held(engine).on_trial == set()
    if fails:
        engine.worker.fail(job.event_id)
    else:
        engine.worker.complete(job.event_id)
    engine.poll()
    engine.check()
    assert engine.scheduler.reset()
    pool = engine.scheduler.tier_pool
    assert len(held(engine)) == 0
    assert pool.num_free() == pool.num_usable_blocks
    assert not pool.index
