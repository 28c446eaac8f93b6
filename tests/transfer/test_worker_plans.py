"""Plan-driven check: many random plans, every loaded block compared byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transfer_helpers import ShadowTiers, fill_random, kv_per_layer, make_worker, random_plan

from kvtier.offload.plan import Tier
from kvtier.storage import DiskIOMode
from kvtier.transfer import WorkerConfig

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_plans_load_exactly_what_was_stored(tmp_path: Path, seed: int) -> None:
    """40 steps of random stores (CPU and DISK) and loads of stored slots, engine bytes
    re-randomised between steps: no load ever returns a wrong byte."""
    rng = np.random.default_rng(seed)
    kv = kv_per_layer(2, 48, (16, 2, 16))
    sizes = {Tier.CPU: 12, Tier.DISK: 12}
    cfg = WorkerConfig(
        cpu_num_slots=12,
        disk_num_slots=12,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_batch_bytes=3 * 4096,
    )
    with make_worker(cfg, kv) as worker:
        shadow = ShadowTiers(worker.regions)
        event_id, num_loads = 1, 0
        for step in range(40):
            fill_random(kv, seed=seed * 1000 + step)
            plan = random_plan(rng, shadow, event_id, sizes)
            event_id += len(plan.jobs)
            num_loads += sum(j.dst_tier is Tier.GPU for j in plan.jobs)
            shadow.on_submit(plan)
            worker.submit(plan)
            if step % 3 == 0:  # a report taken while transfers may still run
                partial = worker.poll()
                assert not partial.failed
                assert shadow.on_report(partial) == []
            worker.flush()
            report = worker.poll()
            assert not report.failed
            # SPEC §6.10 Beyond: every done event comes with its copy time.
            assert report.seconds.keys() == report.done.keys()
            assert all(s >= 0 for s in report.seconds.values())
            assert shadow.on_report(report) == []
            worker.check_invariants()
        assert num_loads > 40
