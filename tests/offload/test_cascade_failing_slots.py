"""Demotions into a disk that fails some writes: bad slots are set aside, and write-back
looks past the blocks it gave up on.

Regressions:
- A failed demotion's disk slots went back to the head of the disk's free queue, so the
  next demotion job got them again: one bad slot (every write into it fails) failed every
  later job, and the disk tier stored nothing more (write-back or write-through; 40
  two-block requests over a 16-block CPU tier lost 64 blocks, demoted none).
- Write-back's window was the next `reserve` free CPU blocks, given-up ones included:
  once given-up blocks filled it, nothing was demoted, so no success showed that the
  disk worked again and the blocks behind them were evicted undemoted.
"""

from __future__ import annotations

import pytest
from sim import make_request
from test_cascade_demotions import WB, cache, free_keys, key, make
from test_scenarios_cascade import cascade_engine

from kvtier.core.block_pool import BlockPool
from kvtier.offload.cascade import Cascade
from kvtier.offload.config import CascadeMode
from kvtier.offload.disk_slots import SetAsideSlots
from kvtier.offload.plan import Tier


def run_over_bad_slots(mode: CascadeMode, bad: set[int]) -> tuple[int, int]:
    """Run 40 two-block requests (distinct prefixes) through a cascade of 16 CPU and 39
    disk blocks whose disk fails every job writing into a `bad` slot; return the
    failed demotion jobs and check the counts."""
    engine = cascade_engine(mode, num_cpu=17, num_disk=40)
    engine.auto_complete = False
    num_failed_jobs = 0

    def step() -> None:
        nonlocal num_failed_jobs
        for job in engine.step().jobs:
            if job.dst_tier is Tier.DISK and bad & set(job.dst_block_ids):
                engine.worker.fail(job.event_id)
                num_failed_jobs += 1
            else:
                engine.worker.complete(job.event_id)
        engine.poll()
        engine.check()

    for i in range(40):
        request = make_request(f"r{i}", range(1000 * i, 1000 * i + 8))
        assert engine.admit(request) is not None
        engine.schedule(request.request_id)
        step()
        engine.finish(request.request_id)
        step()
    for _ in range(10):
        step()
    stats = engine.scheduler.take_stats()
    cascade = engine.scheduler.cascade
    assert cascade is not None
    assert set(cascade.set_aside.bad) == bad
    assert stats.num_disk_slots_held == len(cascade.set_aside) >= len(bad)
    return num_failed_jobs, stats.num_lost_blocks


@pytest.mark.parametrize("bad", [{1}, {7}, {3, 20}])
def test_write_back_sets_a_bad_disk_slot_aside_and_loses_nothing(bad: set[int]) -> None:
    num_failed_jobs, num_lost = run_over_bad_slots(CascadeMode.WRITE_BACK, bad)
    assert num_lost == 0
    assert num_failed_jobs <= 3 * len(bad)  # found by halving the slots on trial


@pytest.mark.parametrize("bad", [{1}, {3, 20}])
def test_write_through_sets_a_bad_disk_slot_aside_and_loses_nothing(bad: set[int]) -> None:
    """Write-through retries a failed demotion (into other slots): no block is lost.
    (Without retries, the blocks of the failed jobs were lost once the CPU evicted them:
    6 with slot {1} bad, 12 with {3, 20}.)"""
    num_failed_jobs, num_lost = run_over_bad_slots(CascadeMode.WRITE_THROUGH, bad)
    assert num_lost == 0
    assert num_failed_jobs <= 3 * len(bad)


def test_trials_bisect_the_suspects_to_the_bad_slot() -> None:
    disk = BlockPool(9)
    aside = SetAsideSlots(disk)
    slots = disk.allocate(4)
    aside.note_failed(slots)  # one of them is bad
    assert aside.suspects == slots
    assert disk.num_free() == 4
    bad = slots[2]
    trials = 0
    for _ in range(10):
        aside.note_succeeded([])  # a demotion elsewhere succeeded
        if not aside.on_trial:
            break
        job = disk.allocate(len(aside.on_trial))
        assert set(job) == aside.on_trial  # given back first
        if bad in job:
            trials += 1
            aside.note_failed(job)
        else:
            disk.free(job)  # (a demotion's slots are cached by now: freed to the tail)
            aside.note_succeeded(job)
    assert aside.bad == [bad]
    assert aside.suspects == []
    assert trials == 3  # 4 slots, then 2, then 1
    assert disk.num_free() == 7
    aside.check_invariants()
    aside.clear()
    assert disk.num_free() == 8


def test_after_a_passing_trial_the_next_group_is_twice_as_large() -> None:
    """A failure that passed (no bad slot) is not bisected to the end: once the halved
    trials pass, all suspects soon come back."""
    disk = BlockPool(17)
    aside = SetAsideSlots(disk)
    aside.note_failed(disk.allocate(8))
    aside.note_succeeded([])
    aside.note_failed(disk.allocate(8))  # all 8 on trial, failed again: groups of 4
    sizes = []
    while aside.suspects or aside.on_trial:
        assert len(sizes) < 8, "the suspects never all came back"
        aside.note_succeeded([])
        job = disk.allocate(len(aside.on_trial))
        sizes.append(len(job))
        disk.free(job)
        aside.note_succeeded(job)
    assert sizes == [4, 4]
    assert aside.trial_size >= 8
    assert disk.num_free() == 16


def test_held_slots_come_back_when_the_disk_has_no_other_room() -> None:
    disk = BlockPool(5)
    aside = SetAsideSlots(disk)
    aside.note_failed(disk.allocate(3))
    aside.make_room(1)  # one is free
    assert len(aside) == 3
    aside.make_room(2)
    assert len(aside) == 0
    assert len(aside.on_trial) == 3
    assert disk.num_free() == 4


def test_a_failed_trial_group_is_bisected_before_the_other_suspects() -> None:
    """A trial group that failed again goes back in front of the suspects, halved, and
    its slots are handed out again in suspect order (the pool reuses them first)."""
    disk = BlockPool(17)
    aside = SetAsideSlots(disk)
    first = disk.allocate(4)
    aside.note_failed(first)
    aside.note_succeeded([])  # all 4 on trial
    job = disk.allocate(4)
    assert job == first  # given back first, in suspect order
    fresh = disk.allocate(2)
    aside.note_failed([*job, *fresh])  # the trial failed, with 2 slots not on trial
    assert aside.suspects == [*first, *fresh]  # the trial's first, to be bisected
    aside.note_succeeded([])
    assert aside.on_trial == set(first[:2])
    assert disk.allocate(2) == first[:2]
    assert aside.suspects == [*first[2:], *fresh]


# ------------------------------------------------------------ the write-back window


def fail_every_victim(reserve: int) -> tuple[BlockPool, BlockPool, Cascade]:
    """A write-back cascade whose 8 cached CPU blocks each failed their demotion once;
    then the disk works again."""
    cpu, disk, cascade = make(WB, reserve=reserve)
    cache(cpu, [key(i) for i in range(8)])
    for _ in range(8):
        cascade.select_write_back()
        cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)
    assert len(cascade.failed) == 8
    cascade.set_aside.clear()
    cascade.take_counters()
    return cpu, disk, cascade


def test_write_back_looks_past_given_up_blocks_and_retries_them_once_one_succeeds() -> None:
    cpu, disk, cascade = fail_every_victim(reserve=2)
    (block,) = cpu.allocate(1)  # evicts the first given-up block; key 8 is stored
    assert cascade.take_counters().num_lost_blocks == 1
    cpu.insert_key(key(8), block, 16)
    cpu.free([block])
    cascade.select_write_back()  # the next victims: 7 given-up blocks, then key 8
    items = cascade.take_queued()
    assert [item.key for item in items] == [key(8)]
    cascade.complete(items, succeeded=True, abandoned=False)
    assert cascade.failed == set()  # the disk works: the given-up blocks are retried
    assert free_keys(cpu)[:2] == [None, key(0)]  # key 8's block left the CPU tier
    cascade.select_write_back()
    assert [item.key for item in cascade.take_queued()] == [key(0)]
    assert disk.cached_block(key(8)) is not None
    cpu.check_invariants()


def test_the_write_back_walk_visits_at_most_four_reserves() -> None:
    """With `reserve` 1 the walk visits 4 victims: the 5th is not demoted even when it
    is the first not given up (a mutant walking on demoted it), the 4th is."""
    cpu, _, cascade = fail_every_victim(reserve=1)
    order = free_keys(cpu)
    for i, demoted in ((4, []), (3, [order[3]])):
        k = order[i]
        assert k is not None
        cascade.failed.discard((cpu.cached_block(k), k))
        cascade.select_write_back()
        assert [item.key for item in cascade.take_queued()] == demoted
