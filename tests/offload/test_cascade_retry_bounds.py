"""Write-through retries: a plan issues a bounded number, and dropped demotions retry too.

Regression 1 (a burst): once retries fell due (the disk working again after a long
fault), one plan issued every one of them, as many demotions as the CPU tier holds
blocks, in a single write job competing with loads, and walked them all to do so. A plan
now issues at most the cascade's `retries_per_plan` (fewer with fewer free disk slots) and looks
at no more than it issues; the rest follow on the next plans.

Regression 2 (dropped demotions): a write-through demotion that found no free disk slot
(every one pinned) was counted as dropped and never tried again, so the block was lost at
its CPU eviction however soon disk slots freed up. It now waits among the retries, with no
attempt spent, and a plan demotes it once slots are free; while none is, a plan walks
nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import SimEngine, make_request
from test_cascade_demotions import WT, cache, key
from test_scenarios_cascade import cascade_engine, holds, keys_of

from example_counts import scaled_examples
from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.offload.cascade import Cascade
from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier


class VisitCountingDict(dict[tuple[int, Key], int]):
    """A dict that counts the entries its walks visit (walks by `iter` only)."""

    num_visits = 0

    def __iter__(self) -> Iterator[tuple[int, Key]]:
        for pair in super().__iter__():
            self.num_visits += 1
            yield pair

    def keys(self):  # type: ignore[no-untyped-def]
        raise AssertionError("an uncounted walk")

    items = values = keys


def test_due_retries_are_issued_a_bounded_number_per_plan() -> None:
    num = 64
    cpu, disk = BlockPool(num + 2), BlockPool(num + 2)
    cascade = Cascade(cpu, disk, WT, reserve=4)
    blocks = cache(cpu, [key(i) for i in range(num + 1)])
    cascade.after_stores(blocks[:num])  # a long disk fault: every demotion fails
    items = cascade.take_queued()
    assert len(items) == num
    cascade.complete(items, succeeded=False, abandoned=False)
    assert len(cascade.retry) == num
    cascade.retry = VisitCountingDict(cascade.retry)
    cascade.after_stores(blocks[num:])  # the disk works again: retries are due at once
    cascade.complete(cascade.take_queued(), succeeded=True, abandoned=False)
    issued_per_plan, visits_per_plan = [], []
    for _ in range(2 * num):
        if not cascade.retry:
            break
        visits = cascade.retry.num_visits
        cascade.select_retries()
        visits_per_plan.append(cascade.retry.num_visits - visits)
        items = cascade.take_queued()
        issued_per_plan.append(len(items))
        cascade.complete(items, succeeded=True, abandoned=False)
    assert max(issued_per_plan) <= cascade.retries_per_plan, f"a burst: {issued_per_plan}"
    assert max(visits_per_plan) <= cascade.retries_per_plan, f"O(pending) walks: {visits_per_plan}"
    assert sum(issued_per_plan) == num
    assert len(issued_per_plan) == num // cascade.retries_per_plan
    assert not cascade.retry
    assert not cascade.retrying
    assert all(disk.cached_block(key(i)) is not None for i in range(num + 1))
    assert cascade.take_counters().num_demoted_blocks == num + 1
    cpu.check_invariants()
    disk.check_invariants()


def test_a_plan_issues_no_more_retries_than_free_disk_slots() -> None:
    cpu, disk = BlockPool(9), BlockPool(9)
    cascade = Cascade(cpu, disk, WT, reserve=4)
    blocks = cache(cpu, [key(i) for i in range(8)])
    cascade.after_stores(blocks[:6])
    cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)
    cascade.set_aside.clear()  # the failed job's slots, back in the pool
    pinned = disk.allocate(disk.num_free() - 1)  # e.g. loads: one disk slot left
    cascade.after_stores(blocks[6:7])  # succeeds: retries due
    cascade.complete(cascade.take_queued(), succeeded=True, abandoned=False)
    assert disk.num_free() == 1
    cascade.select_retries()
    assert len(cascade.take_queued()) == 1
    assert cascade.take_counters().num_dropped_demotions == 0
    disk.free(pinned)


def test_a_plan_looks_past_a_bounded_number_of_retries_in_flight() -> None:
    """Retries whose key is in flight otherwise are skipped, at most `_VISIT_SPAN` times
    the bound of them a plan, and go to the back: the others still get their turn."""
    cpu, disk = BlockPool(9), BlockPool(9)
    cascade = Cascade(cpu, disk, WT, reserve=1)
    blocks = cache(cpu, [key(i) for i in range(8)])
    cascade.after_stores(blocks)
    cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)
    cascade.retry = VisitCountingDict(cascade.retry)
    cascade.in_flight_keys.update(key(i) for i in range(6))  # as if copied otherwise
    issued: list[Key] = []
    for _ in range(4):
        visits = cascade.retry.num_visits
        cascade.select_retries()
        assert cascade.retry.num_visits - visits <= 4
        issued += [item.key for item in cascade.take_queued()]
    assert issued == [key(6), key(7)]


# ------------------------------------------------------------ dropped demotions


def test_a_dropped_demotion_waits_without_walks_then_reaches_disk() -> None:
    cpu, disk = BlockPool(9), BlockPool(5)
    cascade = Cascade(cpu, disk, WT, reserve=2)
    blocks = cache(cpu, [key(i) for i in range(3)])
    pinned = disk.allocate(disk.num_free())  # every disk slot pinned (loads, moves)
    cascade.after_stores(blocks)
    assert cascade.take_queued() == []
    assert cascade.take_counters().num_dropped_demotions == 3
    cascade.retry = VisitCountingDict(cascade.retry)
    for _ in range(10):  # the disk stays full: nothing issued, nothing walked
        cascade.select_retries()
        assert cascade.take_queued() == []
    assert cascade.retry.num_visits == 0, "a plan walked the dropped demotions"
    assert cascade.take_counters().num_dropped_demotions == 0  # counted once
    disk.free(pinned)  # slots free up
    issued: list[Key] = []
    for _ in range(4):
        cascade.select_retries()
        items = cascade.take_queued()
        assert len(items) <= cascade.retries_per_plan
        issued += [item.key for item in items]
        cascade.complete(items, succeeded=True, abandoned=False)
    assert issued == [key(0), key(1), key(2)]
    assert all(disk.cached_block(key(i)) is not None for i in range(3))
    assert not cascade.retry
    assert not cascade.dropped
    cpu.allocate(cpu.num_free())  # evicts them all from the CPU tier
    assert cascade.take_counters().num_lost_blocks == 0
    cpu.check_invariants()
    disk.check_invariants()


def test_a_dropped_demotion_fails_as_a_first_attempt() -> None:
    """Dropped, it spent no attempt: its first written try that fails is its first."""
    cpu, disk = BlockPool(9), BlockPool(5)
    cascade = Cascade(cpu, disk, WT, reserve=2)
    (block,) = cache(cpu, [key(0)])
    pinned = disk.allocate(disk.num_free())
    cascade.after_stores([block])
    assert cascade.retry == {(block, key(0)): 0}
    disk.free(pinned)
    cascade.select_retries()
    cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)
    assert cascade.retry == {(block, key(0)): 1}


def step_holding_demotions(engine: SimEngine, held: list[int]) -> None:
    """Step, completing every job but demotions (their event ids go to `held`)."""
    for job in engine.step().jobs:
        if job.dst_tier is Tier.DISK:
            held.append(job.event_id)
        else:
            engine.worker.complete(job.event_id)
    engine.poll()
    engine.check()


def test_a_dropped_write_through_block_survives_its_cpu_eviction() -> None:
    """A full disk (every slot pinned by demotions in flight) drops "b"'s demotions;
    once they land, "b" reaches disk and still hits after the CPU tier evicted it."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=9, num_disk=5)
    engine.auto_complete = False
    held: list[int] = []
    for request_id, tokens in [("a", range(16)), ("b", range(100, 108))]:
        assert engine.admit(make_request(request_id, tokens)) is not None
        engine.schedule(request_id)
        step_holding_demotions(engine, held)
        engine.finish(request_id)
        step_holding_demotions(engine, held)
    assert engine.scheduler.take_stats().num_dropped_demotions == 2  # "b"'s two blocks
    b_keys = keys_of(range(100, 108), 2)
    for event_id in held:  # "a"'s demotions land: the disk has room again
        engine.worker.complete(event_id)
    engine.poll()
    engine.auto_complete = True
    for _ in range(4):
        engine.step()
        engine.check()
    assert all(holds(engine, Tier.DISK, k) for k in b_keys), "a dropped demotion was lost"
    cpu_pool = engine.scheduler.tier_pool  # the CPU tier evicts every cached block
    cpu_pool.free(cpu_pool.allocate(cpu_pool.num_free())[::-1])
    assert not any(holds(engine, Tier.CPU, k) for k in b_keys)
    engine.evict_gpu()
    assert engine.run(make_request("again", [*range(100, 108), 1])).num_accepted_tokens == 8
    engine.check()


def test_a_block_stored_while_its_key_is_in_flight_from_another_reaches_disk() -> None:
    """Regression: write-through skipped a block whose key another CPU block's demotion
    had in flight, and never demoted it. That block's keys were discarded meanwhile (a
    failed load found it corrupt), so its copy registers nothing: the block stored
    afresh was never on disk, lost at its CPU eviction. It now waits among the retries."""
    cpu, disk = BlockPool(9), BlockPool(9)
    cascade = Cascade(cpu, disk, WT, reserve=2)
    (old,) = cache(cpu, [key(0)])
    cascade.after_stores([old])
    items = cascade.take_queued()
    cascade.before_cpu_discard(old)  # a failed load read it: never served again
    cpu.discard_keys(old)
    (new,) = cache(cpu, [key(0)])  # the request recomputed and stored it again
    cascade.after_stores([new])
    assert cascade.take_queued() == []  # one copy of a key at a time
    cascade.complete(items, succeeded=True, abandoned=False)
    assert disk.cached_block(key(0)) is None  # the discarded copy registered nothing
    cascade.select_retries()
    retried = cascade.take_queued()
    assert [(item.cpu_block_id, item.key) for item in retried] == [(new, key(0))]
    cascade.complete(retried, succeeded=True, abandoned=False)
    assert disk.cached_block(key(0)) is not None
    assert not cascade.retry
    assert not cascade.retrying
    cpu.allocate(cpu.num_free())  # the CPU tier evicts it
    assert cascade.take_counters().num_lost_blocks == 0
    cpu.check_invariants()
    disk.check_invariants()


def test_a_block_stored_again_while_its_own_demotion_is_in_flight_moves_once() -> None:
    """The same block reported stored twice before its copy lands: one copy, and once it
    lands nothing is left to retry."""
    cpu, disk = BlockPool(9), BlockPool(9)
    cascade = Cascade(cpu, disk, WT, reserve=2)
    (block,) = cache(cpu, [key(0)])
    cascade.after_stores([block])
    items = cascade.take_queued()
    cascade.after_stores([block])
    cascade.select_retries()
    assert cascade.take_queued() == []
    cascade.complete(items, succeeded=True, abandoned=False)
    assert not cascade.retry
    cascade.select_retries()
    assert cascade.take_queued() == []


# ------------------------------------------------------------ the per-plan bound


def test_the_retry_bound_is_its_own_setting() -> None:
    """`retries_per_plan`, not write-back's `reserve`, bounds a plan's retries."""
    num = 12
    cpu, disk = BlockPool(num + 2), BlockPool(num + 2)
    cascade = Cascade(cpu, disk, WT, reserve=8, retries_per_plan=3)
    blocks = cache(cpu, [key(i) for i in range(num + 1)])
    cascade.after_stores(blocks[:num])
    cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)
    cascade.after_stores(blocks[num:])  # the disk works again: every retry is due
    cascade.complete(cascade.take_queued(), succeeded=True, abandoned=False)
    issued = []
    while cascade.retry:
        cascade.select_retries()
        items = cascade.take_queued()
        issued.append(len(items))
        cascade.complete(items, succeeded=True, abandoned=False)
    assert issued == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="retries_per_plan must be an int >= 1, got 0"):
        Cascade(cpu, disk, WT, reserve=8, retries_per_plan=0)


@pytest.mark.parametrize(
    ("reserve", "retries_per_plan", "message"),
    [
        (2, 2.5, "retries_per_plan must be an int >= 1, got 2.5"),
        (2, "3", "retries_per_plan must be an int >= 1, got '3'"),
        (2, True, "retries_per_plan must be an int >= 1, got True"),
        (2, -1, "retries_per_plan must be an int >= 1, got -1"),
        (1.5, None, "reserve must be an int >= 1, got 1.5"),
        (None, 2, "reserve must be an int >= 1, got None"),
    ],
)
def test_a_bound_that_is_not_an_int_of_at_least_1_is_refused(
    reserve: object, retries_per_plan: object, message: str
) -> None:
    """Regression: a float bound was accepted, and never reached by the count of the
    retries a plan chose (2.5 let a plan issue 10, its walk's span); a string or None
    raised a TypeError about `<` that named neither the setting nor the value."""
    cpu, disk = BlockPool(4), BlockPool(4)
    with pytest.raises(ValueError, match=re.escape(message)):
        Cascade(cpu, disk, WT, reserve=reserve, retries_per_plan=retries_per_plan)  # type: ignore[arg-type]


@settings(max_examples=scaled_examples(300), deadline=None)
@given(
    num=st.integers(1, 24),
    bound=st.integers(1, 5),
    reserve=st.integers(1, 5),
    num_pinned=st.integers(0, 8),
    data=st.data(),
)
def test_no_plan_issues_more_retries_than_its_bound(
    num: int, bound: int, reserve: int, num_pinned: int, data: st.DataObject
) -> None:
    """Whatever the failures and free disk slots, a plan issues at most `retries_per_plan`
    retries and no more than the disk slots it could write into; once the disk works
    and its slots free up, every retry not given up reaches disk."""
    cpu, disk = BlockPool(num + 2), BlockPool(num + 2)
    cascade = Cascade(cpu, disk, WT, reserve=reserve, retries_per_plan=bound)
    evicted: set[Key] = set()  # from disk, to make room
    disk.on_evict = lambda _block, k: evicted.add(k)
    blocks = cache(cpu, [key(i) for i in range(num + 1)])
    cascade.after_stores(blocks[:num])
    cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)
    pinned = disk.allocate(min(num_pinned, disk.num_free()))  # loads, moves
    cascade.after_stores(blocks[num:])
    cascade.complete(cascade.take_queued(), succeeded=True, abandoned=False)
    for plan in range(400):
        if not cascade.retry:
            break
        if pinned and (plan > 40 or data.draw(st.booleans(), label="free the pinned")):
            disk.free(pinned)
            pinned = []
        writable = disk.num_free() + len(cascade.set_aside)
        cascade.select_retries()
        items = cascade.take_queued()
        assert len(items) <= min(bound, writable), (len(items), bound, writable)
        works = plan > 40 or data.draw(st.booleans(), label="the disk works")
        cascade.complete(items, succeeded=works, abandoned=False)
    assert not cascade.retry
    assert not cascade.retrying
    given_up = [k for k in map(key, range(num)) if not disk.cached_block(k) and k not in evicted]
    # A given-up demotion failed MAX_DEMOTION_ATTEMPTS times, the others at least once.
    assert cascade.take_counters().num_failed_demotions >= num + 2 * len(given_up)
    cpu.check_invariants()
    disk.check_invariants()


def test_a_dropped_retry_whose_key_reached_disk_otherwise_is_forgotten() -> None:
    """Regression: a dropped demotion waiting among the retries whose key reached disk
    by another path (here another CPU block holding it as a secondary key) left its
    retry when a plan found the key on disk, but stayed counted as dropped until the
    block left the CPU tier: had its disk copy gone and its next demotion been dropped
    again, that drop was not counted."""
    cpu, disk = BlockPool(9), BlockPool(5)
    cascade = Cascade(cpu, disk, WT, reserve=2)
    (block,) = cache(cpu, [key(0)])
    pinned = disk.allocate(disk.num_free())  # every disk slot pinned: dropped
    cascade.after_stores([block])
    assert cascade.take_counters().num_dropped_demotions == 1
    disk.free(pinned)
    (other,) = cache(cpu, [key(1)])
    cpu.insert_key(key(0), other, 16)  # key 0 reaches disk with it
    cascade.after_stores([other])
    cascade.complete(cascade.take_queued(), succeeded=True, abandoned=False)
    assert disk.cached_block(key(0)) is not None
    cascade.select_retries()  # finds key 0 on disk: nothing to retry
    assert cascade.take_queued() == []
    assert not cascade.retry
    assert not cascade.dropped, "a retry on disk is still counted as dropped"
    disk.evict_keys(disk.cached_block(key(0)))  # the disk loses it; stored again, dropped
    pinned = disk.allocate(disk.num_free())
    cascade.after_stores([block])
    assert cascade.take_counters().num_dropped_demotions == 1
    disk.free(pinned)
    cpu.check_invariants()
    disk.check_invariants()
