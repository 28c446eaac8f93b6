"""Stores into a disk-only tier (no CPU tier, no cascade) whose disk fails some writes:
a failed store's disk slots are set aside (`disk_slots`), as a failed demotion's are.

Regression: a failed store's disk slots were freed unhashed, to the head of the disk's
free queue, so the next store job got them again: one bad slot (every write into it
fails) failed every later store, and the tier stored nothing more (40 two-block requests
over a 39-block disk with slot 1 bad: 0 of 80 blocks stored, 40 of 40 jobs failed).
"""

from __future__ import annotations

import pytest
from sim import SimEngine, full_layout, make_request
from test_scenarios_cascade import next_job

from kvtier.offload.config import OffloadConfig, StoreMode
from kvtier.offload.disk_slots import SetAsideSlots
from kvtier.offload.plan import Tier


def disk_engine(num_disk: int, **kwargs: object) -> SimEngine:
    """An engine whose one tier is a disk of `num_disk` blocks (null block included)."""
    cfg = OffloadConfig(disk_bytes=1 << 21, disk_path="unused", **kwargs)  # type: ignore[arg-type]
    engine = SimEngine(full_layout(), cfg, num_gpu_blocks=16, num_tier_blocks=num_disk)
    engine.auto_complete = False
    return engine


def held(engine: SimEngine) -> SetAsideSlots:
    set_aside = engine.scheduler.disk_set_aside
    assert set_aside is not None
    return set_aside


class BadDisk:
    """Runs an engine whose disk fails every job writing into a `bad` slot."""

    def __init__(self, engine: SimEngine, bad: set[int]) -> None:
        self.engine = engine
        self.bad = bad
        self.num_failed_jobs = 0

    def step(self) -> None:
        engine = self.engine
        for job in engine.step().jobs:
            if job.dst_tier is Tier.DISK and self.bad & set(job.dst_block_ids):
                engine.worker.fail(job.event_id)
                self.num_failed_jobs += 1
            else:
                engine.worker.complete(job.event_id)
        engine.poll()
        engine.check()

    def run(self, request_id: str, first_token: int) -> int:
        """Admit, compute and finish an 8-token request; return its tier hit in tokens."""
        engine = self.engine
        request = make_request(request_id, range(first_token, first_token + 8))
        admission = engine.admit(request)
        assert admission is not None
        while request_id in engine.loading:  # loads are checked against the content
            self.step()
        engine.schedule(request_id)
        self.step()
        engine.finish(request_id)
        self.step()
        return admission.num_accepted_tokens


@pytest.mark.parametrize("mode", [StoreMode.EAGER, StoreMode.LAZY])
@pytest.mark.parametrize("bad", [{1}, {7}, {3, 20}])
def test_a_bad_disk_slot_is_set_aside_and_the_disk_keeps_storing(
    bad: set[int], mode: StoreMode
) -> None:
    """40 two-block requests over a 39-block disk-only tier with `bad` slots."""
    disk = BadDisk(disk_engine(40, store_mode=mode), bad)
    for i in range(40):
        disk.run(f"r{i}", 1000 * i)
    for _ in range(10):
        disk.step()
    stats = disk.engine.scheduler.take_stats()
    assert disk.num_failed_jobs <= 3 * len(bad)  # found by halving the slots on trial
    assert stats.num_failed_stores <= 2 * disk.num_failed_jobs
    assert stats.num_stored_blocks >= 80 - stats.num_failed_stores  # lazy retries some
    assert set(held(disk.engine).bad) == bad
    assert stats.num_disk_slots_held == len(held(disk.engine)) >= len(bad)
    # What was stored is served, right: the GPU cache is evicted, the KV loaded from disk.
    disk.engine.evict_gpu()
    hits = [disk.run(f"again{i}", 1000 * i) for i in range(30, 40)]
    assert sum(hits) >= 4 * 8  # 7 of each 8 tokens can hit (the last is computed)
    assert set(held(disk.engine).bad) == bad  # never handed out while held


@pytest.mark.parametrize("events", [False, True])  # True: the per-block `try_select` path
def test_held_disk_slots_come_back_when_the_disk_has_no_other_room(events: bool) -> None:
    engine = disk_engine(5, events=events)  # 4 usable disk slots
    disk = BadDisk(engine, {1, 2})
    disk.run("r0", 0)  # its 2-block store fails: slots 1 and 2 are held
    assert sorted(held(engine).held()) == [1, 2]
    assert engine.scheduler.tier_pool.num_free() == 2
    disk.bad = set()  # the disk works again
    request = make_request("long", range(100, 116))  # 4 blocks, 2 slots free
    assert engine.admit(request) is not None
    engine.schedule("long")
    disk.step()
    engine.finish("long")  # its 4 blocks are selected: the held slots are needed
    assert len(held(engine)) == 0
    assert held(engine).on_trial == {1, 2}
    disk.step()
    assert engine.scheduler.take_stats().num_stored_blocks == 4
    assert held(engine).on_trial == set()  # written: the disk works


def test_a_reset_gives_the_held_disk_slots_back() -> None:
    engine = disk_engine(9)
    disk = BadDisk(engine, {1, 2, 3, 4, 5, 6, 7, 8})  # every write fails
    disk.run("r0", 0)
    disk.run("r1", 100)
    assert len(held(engine)) == 4
    pool = engine.scheduler.tier_pool
    assert pool.num_free() == pool.num_usable_blocks - 4
    assert engine.scheduler.reset()
    assert len(held(engine)) == 0
    assert pool.num_free() == pool.num_usable_blocks
    engine.check()


def test_the_disk_slots_held_gauge_counts_held_slots_until_a_reset() -> None:
    engine = disk_engine(9)
    scheduler = engine.scheduler
    disk = BadDisk(engine, {1, 2, 3, 4, 5, 6, 7, 8})  # every write fails
    assert scheduler.take_stats().num_disk_slots_held == 0
    disk.run("r0", 0)
    assert scheduler.stats_gauges()[2] == 2  # a change the adapters' skip test sees
    assert scheduler.take_stats().num_disk_slots_held == 2
    disk.run("r1", 100)
    assert scheduler.take_stats().num_disk_slots_held == 4
    assert scheduler.reset()
    assert scheduler.stats_gauges()[2] == 0
    assert scheduler.take_stats().num_disk_slots_held == 0


def test_an_abandoned_failed_store_frees_its_disk_slots() -> None:
    """A store in flight at a reset registers nothing; failed, its slots are freed (the
    reset gave every held slot back)."""
    engine = disk_engine(9)
    request = make_request("r0", range(8))
    assert engine.admit(request) is not None
    engine.schedule("r0")
    engine.step()
    engine.finish("r0")
    job = next_job(engine, Tier.GPU, Tier.DISK)
    assert not engine.scheduler.reset()  # pending: the store is in flight
    engine.worker.fail(job.event_id)
    engine.poll()
    engine.check()
    assert len(held(engine)) == 0
    pool = engine.scheduler.tier_pool
    assert pool.num_free() == pool.num_usable_blocks


def test_a_cpu_tier_frees_the_slots_of_a_failed_store() -> None:
    """Host memory has no bad slots: a failed CPU store's slots are freed at once."""
    engine = SimEngine(full_layout(), OffloadConfig(cpu_bytes=1 << 20), num_tier_blocks=5)
    engine.auto_complete = False
    assert engine.scheduler.disk_set_aside is None
    BadDisk(engine, set()).run("r0", 0)  # no disk: nothing fails by slot
    request = make_request("r1", range(100, 108))
    assert engine.admit(request) is not None
    engine.schedule("r1")
    engine.step()
    engine.finish("r1")
    engine.worker.fail(next_job(engine, Tier.GPU, Tier.CPU).event_id)
    engine.poll()
    engine.check()
    assert engine.scheduler.take_stats().num_failed_stores == 2
    pool = engine.scheduler.tier_pool
    assert pool.num_free() == pool.num_usable_blocks


def test_held_disk_slots_are_not_counted_as_tier_blocks_in_use() -> None:
    """The gauge counts slots pinned by transfers or lookups (docs/vllm.md): an idle
    disk-only tier that holds slots of failed stores reports none in use."""
    engine = disk_engine(9)
    disk = BadDisk(engine, set(range(1, 9)))  # every write fails
    disk.run("r0", 0)
    assert len(held(engine)) == 2
    assert not engine.scheduler.has_pending_stores()
    assert engine.scheduler.take_stats().num_tier_blocks_in_use == 0
