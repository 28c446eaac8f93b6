"""What `make_cascade` (`offload/scheduler_setup.py`) builds for a CPU+disk config: a disk
tier of at least one usable block, whose events name the disk, and a cascade whose
write-through retries per plan are bounded as its write-back reserve is."""

from __future__ import annotations

import pytest
from sim import SimEngine, full_layout, make_request
from test_scenarios_cascade import cascade_config, cascade_engine

from kvtier.core.events import AllCleared
from kvtier.offload.config import CascadeMode


def test_a_disk_tier_of_the_null_block_only_is_refused() -> None:
    """Block 0 is the null block: a disk tier of 1 block holds nothing (a mutant built
    it, a cascade that could demote nothing)."""
    with pytest.raises(ValueError, match="num_disk_blocks >= 2, got 1"):
        cascade_engine(CascadeMode.WRITE_THROUGH, num_disk=1)
    cascade_engine(CascadeMode.WRITE_THROUGH, num_disk=2)


def test_a_reset_clears_each_tier_under_its_own_medium() -> None:
    """Each tier's pool names its medium in its events: a reset clears "CPU" and "DISK"
    (a mutant built the disk pool as a CPU one: a consumer cleared the CPU tier twice
    and kept the disk tier's keys)."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, events=True)
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.scheduler.take_events()
    assert engine.scheduler.reset()
    cleared = [e.medium for e in engine.scheduler.take_events() if isinstance(e, AllCleared)]
    assert sorted(cleared) == ["CPU", "DISK"]


@pytest.mark.parametrize(("num_cpu", "bound"), [(3, 1), (17, 4), (65, 16)])
def test_retries_per_plan_are_bounded_as_the_write_back_reserve(num_cpu: int, bound: int) -> None:
    """Two steps' worth of blocks, within a quarter of the CPU tier (at least 1): after
    a long disk fault as many retries as the CPU tier holds fall due, and one plan
    issues at most this many (a mutant left them unbounded: a write storm)."""
    engine = SimEngine(
        full_layout(),
        cascade_config(CascadeMode.WRITE_THROUGH),
        num_gpu_blocks=16,
        num_tier_blocks=num_cpu,
        num_disk_blocks=9,
    )
    cascade = engine.scheduler.cascade
    assert cascade is not None
    assert (cascade.retries_per_plan, cascade.reserve) == (bound, bound)
