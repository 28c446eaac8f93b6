"""The CPU+disk cascade (SPEC §7 Beyond): demotion, cross-tier hits, promotion, failures."""

from __future__ import annotations

import logging

import pytest
from sim import SimEngine, block_key, full_layout, make_request

from kvtier.core.events import BlockStored
from kvtier.core.hashing import HashAlgo
from kvtier.offload.config import CascadeMode, ConfigError, OffloadConfig, StoreMode
from kvtier.offload.plan import SlotRecord, Tier, TransferJob
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup

MIB = 1 << 20


def cascade_config(mode: CascadeMode, **kwargs: object) -> OffloadConfig:
    return OffloadConfig(
        cpu_bytes=MIB,
        disk_bytes=2 * MIB,
        disk_path="unused-by-the-fake-worker",
        cascade=mode,
        **kwargs,  # type: ignore[arg-type]
    )


def cascade_engine(
    mode: CascadeMode, num_cpu: int = 5, num_disk: int = 9, **kwargs: object
) -> SimEngine:
    """A cascade of `num_cpu` CPU blocks over `num_disk` disk blocks (null blocks included)."""
    return SimEngine(
        full_layout(),
        cascade_config(mode, **kwargs),
        num_gpu_blocks=16,
        num_tier_blocks=num_cpu,
        num_disk_blocks=num_disk,
    )


def keys_of(tokens: range | list[int], num_blocks: int) -> list[bytes]:
    request = make_request("k", tokens)
    return [block_key(full_layout(), request, 0, i) for i in range(num_blocks)]


def next_job(engine: SimEngine, src: Tier, dst: Tier, max_steps: int = 4) -> TransferJob:
    """Step (completing nothing) until a plan holds a `src` → `dst` job; return it."""
    for _ in range(max_steps):
        for job in engine.step().jobs:
            if (job.src_tier, job.dst_tier) == (src, dst):
                return job
    raise AssertionError(f"no {src.value} -> {dst.value} job")


def holds(engine: SimEngine, tier: Tier, key: bytes) -> bool:
    return engine.scheduler.index.pools[tier].cached_block(key) is not None


def test_write_through_copies_every_cpu_block_to_disk_with_its_bytes() -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH)
    engine.run(make_request("a", range(12)))
    engine.drain()
    kinds = [(job.src_tier, job.dst_tier) for plan in engine.worker.plans for job in plan.jobs]
    assert (Tier.GPU, Tier.CPU) in kinds
    assert (Tier.CPU, Tier.DISK) in kinds
    for key in keys_of(range(12), 3):
        assert holds(engine, Tier.CPU, key)
        assert holds(engine, Tier.DISK, key)
        assert engine.tier_content(key, Tier.DISK) == engine.tier_content(key, Tier.CPU)
    assert engine.scheduler.take_stats().num_demoted_blocks == 3
    engine.check()


def test_cpu_evictions_are_served_from_disk_then_promoted() -> None:
    """A small CPU tier evicts; the disk still hits, loads the bytes, and the CPU gets it back."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=4, num_disk=12)
    engine.run(make_request("a", range(12)))  # 3 blocks, in both tiers
    engine.drain()
    engine.run(make_request("other", range(100, 112)))  # evicts "a" from the CPU tier
    engine.drain()
    a_keys = keys_of(range(12), 3)
    assert not any(holds(engine, Tier.CPU, key) for key in a_keys)
    assert all(holds(engine, Tier.DISK, key) for key in a_keys)
    engine.evict_gpu()
    num_plans = len(engine.worker.plans)
    admission = engine.run(make_request("b", [*range(12), 7]))  # checks the loaded KV
    assert admission.num_accepted_tokens == 12
    jobs = [job for plan in engine.worker.plans[num_plans:] for job in plan.jobs]
    assert [job.src_tier for job in jobs if job.is_load] == [Tier.DISK]
    engine.drain()
    assert all(holds(engine, Tier.CPU, key) for key in a_keys), "not promoted"
    assert engine.scheduler.loads.hit_tokens["DISK"] == 12
    assert engine.scheduler.take_stats().num_promoted_blocks == 3
    engine.check()


def test_a_hit_spanning_cpu_and_disk_loads_in_two_jobs_and_finishes_after_both() -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=4, num_disk=12)
    engine.run(make_request("a", range(12)))
    engine.drain()
    first, *rest = keys_of(range(12), 3)
    engine.scheduler.tier_pool.discard_keys(engine.scheduler.tier_pool.cached_block(first) or 0)
    assert holds(engine, Tier.DISK, first)
    assert all(holds(engine, Tier.CPU, key) for key in rest)
    engine.evict_gpu()
    engine.auto_complete = False
    b = make_request("b", [*range(12), 5])
    assert engine.admit(b) is not None
    plan = engine.step()
    by_tier = {job.src_tier: job for job in plan.jobs if job.is_load}
    assert set(by_tier) == {Tier.CPU, Tier.DISK}
    assert by_tier[Tier.DISK].num_blocks == 1
    assert by_tier[Tier.CPU].num_blocks == 2
    engine.worker.complete(by_tier[Tier.CPU].event_id)
    assert engine.poll().finished_loads == ()  # the disk part is still in flight
    engine.worker.complete(by_tier[Tier.DISK].event_id)
    assert engine.poll().finished_loads == ("b",)
    engine.check()


def test_a_failed_disk_part_fails_the_whole_load_and_drops_only_the_disk_copy() -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=4, num_disk=12)
    engine.run(make_request("a", range(12)))
    engine.drain()
    first, *rest = keys_of(range(12), 3)
    engine.scheduler.tier_pool.discard_keys(engine.scheduler.tier_pool.cached_block(first) or 0)
    engine.evict_gpu()
    engine.auto_complete = False
    b = make_request("b", [*range(12), 5])
    assert engine.admit(b) is not None
    plan = engine.step()
    by_tier = {job.src_tier: job for job in plan.jobs if job.is_load}
    engine.worker.fail(by_tier[Tier.DISK].event_id)
    engine.worker.complete(by_tier[Tier.CPU].event_id)
    outcome = engine.poll()
    assert [(f.request_id, f.start_token, f.end_token) for f in outcome.failed_loads] == [
        ("b", 0, 12)
    ]
    assert not holds(engine, Tier.DISK, first)
    assert all(holds(engine, Tier.CPU, key) for key in rest)
    engine.check()


def test_a_request_whose_load_failed_is_offered_no_hit_until_reallocated() -> None:
    """SPEC §6.8: the engine recomputes, even where another tier still holds a copy."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=5, num_disk=12)
    engine.run(make_request("a", range(12)))
    engine.drain()
    keys = keys_of(range(12), 3)
    assert all(holds(engine, Tier.CPU, k) and holds(engine, Tier.DISK, k) for k in keys)
    engine.evict_gpu()
    engine.auto_complete = False
    b = make_request("b", [*range(12), 5])
    assert engine.admit(b) is not None
    (load,) = [job for job in engine.step().jobs if job.is_load]
    assert load.src_tier is Tier.CPU
    engine.worker.fail(load.event_id)
    assert [f.request_id for f in engine.poll().failed_loads] == ["b"]
    assert all(holds(engine, Tier.DISK, k) and not holds(engine, Tier.CPU, k) for k in keys)
    assert engine.lookup(b).num_offered_tokens == 0  # the disk copy is not offered to b
    assert engine.lookup(make_request("c", [*range(12), 6])).num_offered_tokens == 12
    engine.scheduler.loads.release_pin("c")
    engine.scheduler.on_allocated(b, [[]], 0)  # the engine recomputes b
    assert engine.lookup(b).num_offered_tokens == 12  # a later admission may load again
    engine.scheduler.loads.release_pin("b")
    engine.check()


def test_write_back_demotes_only_the_next_victims_and_then_drops_the_cpu_copy() -> None:
    engine = cascade_engine(CascadeMode.WRITE_BACK, num_cpu=9, num_disk=12)
    engine.run(make_request("a", range(8)))  # 2 blocks stored, far from eviction at first
    engine.drain()
    engine.run(make_request("b", range(200, 224)))  # 6 blocks: "a" nears the CPU's victims
    for _ in range(3):
        engine.step()
    engine.drain()
    a_keys = keys_of(range(8), 2)
    assert any(holds(engine, Tier.DISK, key) for key in a_keys)
    for key in a_keys:
        assert not (holds(engine, Tier.DISK, key) and holds(engine, Tier.CPU, key)), (
            "write-back keeps one copy"
        )
    engine.check()


def demotion_in_flight() -> tuple[SimEngine, TransferJob]:
    """Return a write-through engine whose request "a" is in the CPU tier, being demoted."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH)
    engine.auto_complete = False
    engine.admit(make_request("a", range(8)))
    engine.schedule("a")
    engine.step()
    engine.finish("a")  # selects its blocks for storing
    store = next_job(engine, Tier.GPU, Tier.CPU)
    engine.worker.complete(store.event_id)
    engine.poll()
    demotion = next_job(engine, Tier.CPU, Tier.DISK)
    return engine, demotion


def test_a_failed_demotion_loses_the_disk_copy_and_keeps_the_cpu_one() -> None:
    engine, demotion = demotion_in_flight()
    engine.worker.fail(demotion.event_id)
    engine.poll()
    key = keys_of(range(8), 1)[0]
    assert holds(engine, Tier.CPU, key)
    assert not holds(engine, Tier.DISK, key)
    assert engine.scheduler.take_stats().num_failed_demotions == demotion.num_blocks
    disk = engine.scheduler.index.pools[Tier.DISK]
    held = engine.scheduler.cascade.set_aside.held()  # type: ignore[union-attr]
    assert sorted(held) == sorted(demotion.dst_block_ids)  # set aside, not reused first
    assert disk.num_free() == disk.num_usable_blocks - len(held)
    engine.check()


def test_reset_during_a_demotion_abandons_it() -> None:
    engine, demotion = demotion_in_flight()
    assert engine.scheduler.reset() is False  # the demotion is still in flight
    engine.worker.complete(demotion.event_id)
    engine.poll()
    key = keys_of(range(8), 1)[0]
    assert not holds(engine, Tier.DISK, key), "an abandoned demotion became visible"
    assert engine.scheduler.reset() is True
    engine.check()


def test_events_carry_each_tiers_medium() -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, events=True)
    engine.run(make_request("a", range(8)))
    engine.drain()
    media = {e.medium for e in engine.scheduler.take_events() if isinstance(e, BlockStored)}
    assert media == {"CPU", "DISK"}


@pytest.mark.parametrize("mode", [StoreMode.EAGER, StoreMode.LAZY])
def test_restore_indexes_a_persistent_tiers_slots(mode: StoreMode) -> None:
    layout = full_layout()
    config = OffloadConfig(disk_bytes=MIB, disk_path="unused", disk_persist=True, store_mode=mode)
    scheduler = OffloadScheduler(config, SchedulerSetup(layout, 8))
    key = keys_of(range(8), 1)[0]
    bad_group = key[:-4] + (7).to_bytes(4, "big")
    restored = scheduler.restore(
        Tier.DISK, [(3, SlotRecord(key, 4)), (0, SlotRecord(key, 4)), (4, SlotRecord(bad_group, 4))]
    )
    assert restored == 1
    assert scheduler.tier_pool.cached_block(key) == 3
    with pytest.raises(ValueError, match="CPU is not configured"):
        scheduler.restore(Tier.CPU, [])


def test_stores_into_a_persistent_disk_carry_slot_records() -> None:
    config = OffloadConfig(disk_bytes=MIB, disk_path="unused", disk_persist=True)
    engine = SimEngine(full_layout(), config)
    engine.run(make_request("a", range(8)))
    engine.drain()
    (store,) = [job for plan in engine.worker.plans for job in plan.jobs if job.is_store]
    assert [r.key for r in store.dst_records] == keys_of(range(8), 2)
    assert [r.num_tokens for r in store.dst_records] == [4, 4]


def test_cascade_config_validation(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="disk_bytes=1 is smaller than cpu_bytes=2"):
        OffloadConfig(cpu_bytes=2, disk_bytes=1, disk_path="d")
    OffloadConfig(cpu_bytes=2, disk_bytes=1, disk_path="d", cascade=CascadeMode.WRITE_BACK)
    with pytest.raises(ConfigError, match="needs a fixed hash_seed"):
        OffloadConfig(disk_bytes=1, disk_path="d", disk_persist=True, hash_algo=HashAlgo.XXHASH)
    with pytest.raises(ConfigError, match="disk_persist=True needs a disk tier"):
        OffloadConfig(cpu_bytes=1, disk_persist=True)
    with pytest.raises(ConfigError, match="cascade must be one of"):
        OffloadConfig.from_dict({"cpu_bytes": 1, "disk_bytes": 2, "disk_path": "d", "cascade": "x"})
    with pytest.raises(ConfigError, match=r"cascade must be one of .*, got 'wt'"):
        OffloadConfig(cpu_bytes=1, disk_bytes=2, disk_path="d", cascade="wt")  # type: ignore[arg-type]
    named = OffloadConfig(cpu_bytes=1, disk_bytes=2, disk_path="d", cascade=" Write_Back")  # type: ignore[arg-type]
    assert named.cascade is CascadeMode.WRITE_BACK  # a member's name, as from_dict takes it
    with caplog.at_level(logging.WARNING):
        config = OffloadConfig.from_dict({"cpu_bytes": 1, "cascade": "write_back"})
    assert "cascade needs both" in caplog.text
    assert config.tiers == (Tier.CPU,)
    both = OffloadConfig.from_dict(
        {"cpu_bytes": 4096, "disk_bytes": 8192, "disk_path": "d", "cascade": "write_back"}
    )
    assert both.tiers == (Tier.CPU, Tier.DISK)
    assert both.num_tier_blocks(1024) == 4
    assert both.num_tier_blocks(1024, Tier.DISK) == 8
    with pytest.raises(ValueError, match="num_disk_blocks >= 2"):
        OffloadScheduler(both, SchedulerSetup(full_layout(), 4))


@pytest.mark.parametrize("tiers", ["cpu", "disk", "cpu+disk"])
@pytest.mark.parametrize("mode", list(CascadeMode), ids=lambda m: m.value)
@pytest.mark.parametrize("store_mode", list(StoreMode), ids=lambda m: m.value)
@pytest.mark.parametrize("persist", [False, True], ids=["volatile", "persistent"])
def test_every_tier_combination_builds_and_serves(
    tiers: str, mode: CascadeMode, store_mode: StoreMode, persist: bool
) -> None:
    """Each valid combination builds and round-trips a prefix; invalid ones say why."""
    values: dict[str, object] = {"store_mode": store_mode, "disk_persist": persist}
    if "cpu" in tiers:
        values["cpu_bytes"] = MIB
    if "disk" in tiers:
        values.update(disk_bytes=2 * MIB, disk_path="unused")
    if tiers == "cpu+disk":
        values["cascade"] = mode
    if persist and "disk" not in tiers:
        with pytest.raises(ConfigError, match="disk_persist=True needs a disk tier"):
            OffloadConfig(**values)  # type: ignore[arg-type]
        return
    config = OffloadConfig(**values)  # type: ignore[arg-type]
    engine = SimEngine(
        full_layout(),
        config,
        num_tier_blocks=8,
        num_disk_blocks=12 if config.is_cascade else 0,
    )
    engine.run(make_request("a", range(12)))
    for _ in range(3):  # lazy mode stores blocks once they wait in the GPU free queue
        engine.step()
    engine.drain()
    engine.evict_gpu()
    assert engine.run(make_request("b", [*range(12), 1])).num_accepted_tokens == 12
    engine.drain()
    engine.check()


def test_lost_blocks_count_cpu_evictions_without_a_disk_copy() -> None:
    """Write-through never loses a block while the disk keeps up; a write-back burst larger
    than the demotion reserve evicts dirty blocks, and each one is counted."""
    through = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=5, num_disk=40)
    back = cascade_engine(CascadeMode.WRITE_BACK, num_cpu=9, num_disk=40)
    lost = {}
    for name, engine in (("through", through), ("back", back)):
        total = 0
        for i in range(4):  # 6 blocks each: every request overflows the CPU tier at once
            engine.run(make_request(f"r{i}", range(100 * i, 100 * i + 24)))
            engine.drain()
            total += engine.scheduler.take_stats().num_lost_blocks
        lost[name] = total
        engine.check()
    assert lost["through"] == 0
    assert lost["back"] > 0
