"""Write-through demotions that fail are retried on later plans, a bounded number of times.

Regression: write-through demotes a block once, when the CPU tier registers it. A failed
demotion was dropped: the block was never written to disk while it stayed in the CPU
tier, so its later CPU eviction lost it, however short the disk fault had been (here: one
failed job, the disk fine from then on, the block never on disk). Now a failed block is
retried on a later plan (right away once a demotion succeeds, else after a back-off that
doubles with each failure), at most `MAX_DEMOTION_ATTEMPTS` times in all, so a disk
that fails every write costs a bounded number of writes per block.
"""

from __future__ import annotations

from sim import SimEngine, make_request
from test_cascade_demotions import WT, cache, key, make
from test_cascade_write_back_failures import FailingDisk
from test_scenarios_cascade import cascade_engine, demotion_in_flight, holds, keys_of

from kvtier.core.block_pool import BlockPool
from kvtier.offload.cascade import MAX_DEMOTION_ATTEMPTS, Cascade, MoveItem
from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier


def step_completing_all(engine: SimEngine) -> None:
    engine.step()
    engine.worker.complete_all()
    engine.poll()


def test_a_failed_write_through_demotion_reaches_disk_once_the_disk_works() -> None:
    engine, demotion = demotion_in_flight()
    engine.worker.fail(demotion.event_id)
    engine.poll()
    key0 = keys_of(range(8), 1)[0]
    assert not holds(engine, Tier.DISK, key0)
    for _ in range(8):  # the disk works again
        step_completing_all(engine)
        engine.check()
    assert holds(engine, Tier.DISK, key0), "the failed demotion was never retried"
    assert holds(engine, Tier.CPU, key0)
    assert engine.tier_content(key0, Tier.DISK) == engine.tier_content(key0, Tier.CPU)
    stats = engine.scheduler.take_stats()
    assert stats.num_demoted_blocks == demotion.num_blocks
    cascade = engine.scheduler.cascade
    assert cascade is not None
    assert not cascade.retry
    engine.check()


def test_a_retried_block_survives_its_cpu_eviction() -> None:
    """The hit rate cost: after a transient fault, the evicted block still hits (disk)."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=5, num_disk=40)
    engine.auto_complete = False
    disk = FailingDisk(engine)
    disk.run("a", range(8))
    disk.step()  # its demotion is issued
    disk.step()  # and fails
    assert engine.scheduler.take_stats().num_failed_demotions == 2
    engine.auto_complete = True  # the disk works again
    for _ in range(8):
        engine.step()
    engine.run(make_request("big", range(1000, 1024)))  # 6 blocks: evicts "a" from CPU
    engine.drain()
    assert not holds(engine, Tier.CPU, keys_of(range(8), 1)[0])
    assert engine.scheduler.take_stats().num_lost_blocks == 0
    engine.evict_gpu()
    assert engine.run(make_request("again", [*range(8), 1])).num_accepted_tokens == 8
    engine.check()


def test_a_disk_failing_every_write_gets_a_bounded_number_of_attempts() -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=9, num_disk=12)
    disk = FailingDisk(engine)
    for i in range(4):
        disk.run(f"r{i}", range(100 * i, 100 * i + 8))  # 2 blocks each: 8 in CPU
    for _ in range(300):
        disk.step()
    assert disk.num_demoted == 8 * MAX_DEMOTION_ATTEMPTS
    assert not engine.worker.in_flight
    assert not engine.scheduler.has_pending_stores()
    cascade = engine.scheduler.cascade
    assert cascade is not None
    assert not cascade.retry  # all given up
    stats = engine.scheduler.take_stats()
    assert stats.num_failed_demotions == disk.num_demoted
    assert stats.num_demoted_blocks == 0
    for i in range(4):  # the CPU copies stay and still hit
        for k in keys_of(range(100 * i, 100 * i + 8), 2):
            assert holds(engine, Tier.CPU, k)
            assert not holds(engine, Tier.DISK, k)
    engine.check()


# ------------------------------------------------------------ Cascade on its own


def fail_queued(cascade: Cascade) -> list[bytes]:
    items = cascade.take_queued()
    if items:  # as a plan issues a job only for demotions
        cascade.complete(items, succeeded=False, abandoned=False)
    return [item.key for item in items]


def retries_in_flight(cascade: Cascade, blocks: list[int]) -> list[MoveItem]:
    """Register `blocks` in the CPU tier, fail their write-through demotions and plan
    past the back-off (2 plans); return the retries issued, in flight now."""
    cascade.after_stores(blocks)
    fail_queued(cascade)
    for _ in range(2):  # the back-off: 2 plans
        cascade.select_retries()
    return cascade.take_queued()


def retried_on_plans(cascade: Cascade, num_plans: int) -> list[int]:
    """Plan `num_plans` times, failing every retry; return the plans (0-based) that
    retried something."""
    plans = []
    for plan in range(num_plans):
        cascade.select_retries()
        if fail_queued(cascade):
            plans.append(plan)
    return plans


def test_retries_back_off_and_stop_after_the_last_attempt() -> None:
    cpu, _, cascade = make(WT)
    blocks = cache(cpu, [key(0), key(1)])
    cascade.after_stores(blocks)
    assert fail_queued(cascade) == [key(0), key(1)]
    assert cascade.retry == {(blocks[0], key(0)): 1, (blocks[1], key(1)): 1}
    # Waits of 2 then 4 plans after the first and second failures.
    assert retried_on_plans(cascade, 40) == [1, 5][: MAX_DEMOTION_ATTEMPTS - 1]
    assert cascade.retry == {}
    assert cascade.take_counters().num_failed_demotions == 2 * MAX_DEMOTION_ATTEMPTS
    cpu.check_invariants()


def test_the_back_off_doubles_up_to_32_plans() -> None:
    """Six failed reports in a row: the next retry waits 32 plans (2, 4, ... doubling,
    at most 32), so a disk down for long is written to rarely (a mutant capping the wait
    at 4 plans retried on plan 3)."""
    cpu, _, cascade = make(WT)
    blocks = cache(cpu, [key(i) for i in range(6)])
    for block in blocks:  # each its own failed report
        cascade.after_stores([block])
        fail_queued(cascade)
    assert retried_on_plans(cascade, 40)[:1] == [31]
    cpu.check_invariants()


def test_a_success_ends_the_back_off() -> None:
    cpu, disk, cascade = make(WT)
    blocks = cache(cpu, [key(0), key(1)])
    cascade.after_stores(blocks[:1])
    fail_queued(cascade)
    cascade.after_stores(blocks[1:])  # the disk works again
    cascade.complete(cascade.take_queued(), succeeded=True, abandoned=False)
    cascade.select_retries()
    items = cascade.take_queued()
    assert [item.key for item in items] == [key(0)]
    cascade.complete(items, succeeded=True, abandoned=False)
    assert cascade.retry == {}
    assert disk.cached_block(key(0)) is not None
    assert cascade.take_counters().num_demoted_blocks == 2
    cpu.check_invariants()
    disk.check_invariants()


def test_a_retry_is_forgotten_when_its_block_is_evicted_or_discarded() -> None:
    cpu, _, cascade = make(WT)
    blocks = cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    cascade.after_stores(blocks)
    fail_queued(cascade)
    assert len(cascade.retry) == cpu.num_usable_blocks
    cascade.before_cpu_discard(blocks[-1])
    cpu.discard_keys(blocks[-1])
    assert (blocks[-1], key(cpu.num_usable_blocks - 1)) not in cascade.retry
    cpu.allocate(3)  # evicts three (the discarded block first)
    assert len(cascade.retry) == cpu.num_usable_blocks - 3
    assert cascade.take_counters().num_lost_blocks == 2
    cascade.forget_all()
    assert cascade.retry == {}


def test_a_retry_whose_key_reached_disk_otherwise_is_dropped() -> None:
    cpu, disk, cascade = make(WT)
    (block,) = cache(cpu, [key(0)])
    cascade.after_stores([block])
    fail_queued(cascade)
    (slot,) = disk.allocate(1)  # e.g. a disk copy restored or written by a store
    disk.insert_key(key(0), slot, 16)
    disk.free([slot])
    for _ in range(4):
        cascade.select_retries()
        assert cascade.take_queued() == []
    assert cascade.retry == {}


class CountingDict(dict[tuple[int, bytes], int]):
    """A dict that counts the walks over it."""

    num_walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.num_walks += 1
        return super().__iter__()


def test_a_plan_does_not_walk_the_retries_in_flight() -> None:
    """After a long disk fault as many retries as the CPU tier has blocks may be in flight
    at once; each plan walked them all again until their report (5 ms a plan for 50,000),
    only to find every one in flight. Retries in flight now wait apart (`retrying`)."""
    cpu, _, cascade = make(WT, reserve=8)  # a plan may issue them all
    blocks = cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    items = retries_in_flight(cascade, blocks)
    cascade.retry = CountingDict(cascade.retry)
    assert len(items) == len(blocks)  # every block retried, in flight now
    walks = cascade.retry.num_walks
    for _ in range(10):
        cascade.select_retries()
    assert cascade.take_queued() == []
    assert cascade.retry.num_walks == walks, "a plan walked the retries in flight"
    cascade.complete(items, succeeded=False, abandoned=False)  # back to waiting
    assert cascade.retry == {(it.cpu_block_id, it.key): 2 for it in items}
    assert cascade.retrying == {}


def test_issued_retries_wait_apart_while_disk_slots_are_free() -> None:
    """As above, with free disk slots left after the retries were issued: a plan that
    may issue more still walks none of those in flight (a mutant left them among the
    waiting retries: the next plans walked them, the disk being not full)."""
    cpu, disk = BlockPool(9), BlockPool(20)
    cascade = Cascade(cpu, disk, WT, reserve=8)
    blocks = cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    items = retries_in_flight(cascade, blocks)
    cascade.retry = CountingDict(cascade.retry)
    assert len(items) == len(blocks)
    assert disk.num_free() > 0
    assert set(cascade.retrying) == {(it.cpu_block_id, it.key) for it in items}
    walks = cascade.retry.num_walks
    for _ in range(3):
        cascade.select_retries()
    assert cascade.take_queued() == []
    assert cascade.retry.num_walks == walks, "a plan walked the retries in flight"


def test_a_failed_demotion_of_a_block_that_lost_its_key_meanwhile_is_not_retried() -> None:
    """A demotion fails after its CPU block lost the key it copied (discarded, e.g. a
    failed load): nothing of that key is left to demote, so no retry waits for it (a
    mutant kept one: a retry entry no plan could issue nor drop, its block's new key
    demoted in its name)."""
    cpu, _, cascade = make(WT)
    (block,) = cache(cpu, [key(0)])
    cascade.after_stores([block])
    items = cascade.take_queued()
    assert [item.key for item in items] == [key(0)]
    cascade.before_cpu_discard(block)
    cpu.discard_keys(block)
    cascade.complete(items, succeeded=False, abandoned=False)
    assert cascade.retry == {}
    cpu.check_invariants()
