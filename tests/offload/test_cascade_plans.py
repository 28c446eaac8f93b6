"""What the cascade's plans carry and how CPU hits keep the disk's order (SPEC §6.4, §7 Beyond)."""

from __future__ import annotations

import pytest
from sim import SimEngine, full_layout, make_request
from test_scenarios_cascade import MIB, cascade_engine, holds, keys_of

from kvtier.offload.config import CascadeMode, OffloadConfig
from kvtier.offload.plan import Tier, TransferJob


def jobs(engine: SimEngine, src: Tier, dst: Tier) -> list[TransferJob]:
    plans = engine.worker.plans
    return [
        job for plan in plans for job in plan.jobs if (job.src_tier, job.dst_tier) == (src, dst)
    ]


def test_a_persistent_cascade_records_only_what_reaches_the_disk() -> None:
    """Slot records name what a persistent disk slot holds: demotions into the disk carry
    them, stores into the (volatile) CPU tier carry none."""
    config = OffloadConfig(
        cpu_bytes=MIB,
        disk_bytes=2 * MIB,
        disk_path="unused",
        cascade=CascadeMode.WRITE_THROUGH,
        disk_persist=True,
    )
    engine = SimEngine(full_layout(), config, num_tier_blocks=5, num_disk_blocks=9)
    engine.run(make_request("a", range(8)))
    engine.drain()
    (store,) = jobs(engine, Tier.GPU, Tier.CPU)
    assert store.dst_records == ()
    (demotion,) = jobs(engine, Tier.CPU, Tier.DISK)
    assert [r.key for r in demotion.dst_records] == keys_of(range(8), 2)
    assert [r.num_tokens for r in demotion.dst_records] == [4, 4]


@pytest.mark.parametrize("cascade", [False, True], ids=["disk", "cpu+disk"])
def test_a_volatile_disk_gets_no_slot_records(cascade: bool) -> None:
    """Without disk_persist nothing is written to a manifest: no job carries records."""
    values: dict[str, object] = {"disk_bytes": 2 * MIB, "disk_path": "unused"}
    if cascade:
        values.update(cpu_bytes=MIB, cascade=CascadeMode.WRITE_THROUGH)
    config = OffloadConfig(**values)  # type: ignore[arg-type]
    engine = SimEngine(
        full_layout(), config, num_tier_blocks=5, num_disk_blocks=9 if cascade else 0
    )
    engine.run(make_request("a", range(8)))
    engine.drain()
    all_jobs = [job for plan in engine.worker.plans for job in plan.jobs]
    assert len(all_jobs) == (2 if cascade else 1)
    assert all(job.dst_records == () for job in all_jobs)


def test_write_through_cpu_hits_keep_their_disk_copies_from_eviction() -> None:
    """Write-through: a load served from the CPU refreshes the blocks' disk copies, so
    the disk evicts blocks nobody used since (here b's) rather than the hot ones (a's)."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=9, num_disk=5)
    engine.run(make_request("a", range(8)))  # a's 2 blocks: CPU and disk
    engine.drain()
    engine.run(make_request("b", range(100, 108)))  # b's 2 blocks: the disk is full
    engine.drain()
    engine.evict_gpu()
    hit = engine.run(make_request("a2", [*range(8), 1]))  # a's blocks load from the CPU
    assert hit.num_accepted_tokens == 8
    assert [job.src_tier for job in jobs(engine, Tier.CPU, Tier.GPU)] == [Tier.CPU]
    engine.drain()
    engine.run(make_request("c", range(200, 208)))  # 2 disk slots needed: 2 evicted
    engine.drain()
    assert [holds(engine, Tier.DISK, k) for k in keys_of(range(8), 2)] == [True, True]
    assert [holds(engine, Tier.DISK, k) for k in keys_of(range(100, 108), 2)] == [False, False]
    engine.check()
