"""Cascade plans: slot records, disk order after CPU hits, split hit tokens (SPEC §6.4, §6.10)."""

from __future__ import annotations

import pytest
from sim import SimEngine, block_key, full_layout, make_request
from test_scenarios_cascade import MIB, cascade_config, cascade_engine, holds, keys_of, next_job

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import CascadeMode, OffloadConfig
from kvtier.offload.plan import Tier, TransferJob

FULL = GroupKind.FULL_ATTENTION
SLIDING = GroupKind.SLIDING_WINDOW


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


@pytest.mark.parametrize("cascade", [False, True], ids=["disk", "cpu+disk"])
def test_after_a_reset_of_a_persistent_disk_no_job_carries_records(cascade: bool) -> None:
    """`TransferPlan.end_persistence`: after a reset, KV stored may be of other weights
    than the fingerprint names, so every later plan says persistence ended and no job
    into the disk carries slot records for its manifest (SPEC §6.9)."""
    values: dict[str, object] = {"disk_bytes": 2 * MIB, "disk_path": "unused"}
    if cascade:
        values.update(cpu_bytes=MIB, cascade=CascadeMode.WRITE_THROUGH)
    config = OffloadConfig(**values, disk_persist=True)  # type: ignore[arg-type]
    engine = SimEngine(
        full_layout(), config, num_tier_blocks=5, num_disk_blocks=9 if cascade else 0
    )
    engine.run(make_request("a", range(8)))
    engine.drain()
    into_disk = [
        job for plan in engine.worker.plans for job in plan.jobs if job.dst_tier is Tier.DISK
    ]
    assert [len(job.dst_records) for job in into_disk] == [2]
    assert engine.scheduler.reset()
    seen = len(engine.worker.plans)
    engine.run(make_request("b", range(100, 108)))
    engine.drain()
    later = engine.worker.plans[seen:]
    assert later
    assert all(plan.end_persistence for plan in later)
    into_disk = [job for plan in later for job in plan.jobs if job.dst_tier is Tier.DISK]
    assert [job.dst_records for job in into_disk] == [()]
    engine.check()


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


def test_a_hybrid_hit_spanning_both_tiers_counts_every_accepted_token_once() -> None:
    """SPEC §6.10 Beyond (hit tokens per tier): a load's tokens are split between the
    tiers in proportion to their blocks. With two groups the split does not divide evenly
    (4 of 5 blocks from the CPU: 9.6 tokens); it is rounded and adds up to the accepted
    tokens."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), KVGroupSpec(SLIDING, 4, 64, 8)))
    engine = SimEngine(
        layout,
        cascade_config(CascadeMode.WRITE_THROUGH),
        num_gpu_blocks=32,
        num_tier_blocks=16,
        num_disk_blocks=16,
    )
    a = make_request("a", range(12))
    engine.run(a)
    engine.drain()
    pool = engine.scheduler.tier_pool
    pool.discard_keys(pool.cached_block(block_key(layout, a, 0, 0)) or 0)  # on disk only
    engine.evict_gpu()
    b = make_request("b", [*range(12), 5])
    assert engine.run(b).num_accepted_tokens == 12  # 3 full + 2 window blocks: 4 CPU, 1 disk
    hit_tokens = engine.scheduler.take_stats().hit_tokens
    assert hit_tokens == {"CPU": 10, "DISK": 2}  # 12 x 4/5 and 12 x 1/5, rounded


def test_reset_drops_demotions_queued_but_not_yet_issued() -> None:
    """SPEC §6.9: never-issued transfers are dropped at once, demotions too: a write-through
    demotion queued by a store's completion does not keep its CPU and disk pins, so the
    reset empties both tiers and the next plan demotes nothing."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH)
    store = engine.store_of_finished(make_request("a", range(8)))
    engine.worker.complete(store.event_id)
    engine.poll()  # registered in the CPU tier; its demotion is queued
    assert engine.scheduler.has_pending_stores()
    assert engine.scheduler.reset() is True
    assert not engine.scheduler.has_pending_stores()
    assert engine.step().jobs == ()
    for tier in (Tier.CPU, Tier.DISK):
        assert not any(holds(engine, tier, k) for k in keys_of(range(8), 2))
    engine.check()


def test_write_back_demotes_a_quarter_of_the_cpu_tier_ahead_of_eviction() -> None:
    """Write-back's reserve: each plan demotes the CPU tier's next victims, at most a
    quarter of its usable blocks (8 here: 2) when that is below lazy mode's target."""
    engine = cascade_engine(CascadeMode.WRITE_BACK, num_cpu=9, num_disk=12)
    engine.run(make_request("a", range(32)))  # 8 blocks fill the CPU tier
    demotion = next_job(engine, Tier.CPU, Tier.DISK)
    assert demotion.num_blocks == 2


def test_a_promotion_is_reported_by_one_take_stats_only() -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=4, num_disk=12)
    engine.run(make_request("a", range(12)))
    engine.drain()
    engine.run(make_request("other", range(100, 112)))  # evicts "a" from the CPU tier
    engine.drain()
    engine.evict_gpu()
    engine.run(make_request("b", [*range(12), 7]))  # served from disk, stored to the CPU
    engine.drain()
    assert engine.scheduler.take_stats().num_promoted_blocks == 3
    assert engine.scheduler.take_stats().num_promoted_blocks == 0
