"""`Cascade` on its own (offload/cascade.py): which CPU blocks it demotes, how it keeps the
disk's order, and what a finished demotion leaves in each tier (docs/vllm.md "CPU and
disk together"; the cascade model of docs/policies.md; SPEC §4 tail-first release)."""

from __future__ import annotations

import random

import pytest

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.policies import EVICTION_POLICIES
from kvtier.core.policies.arc import ARCPolicy
from kvtier.offload.cascade import Cascade
from kvtier.offload.config import CascadeMode

WT, WB = CascadeMode.WRITE_THROUGH, CascadeMode.WRITE_BACK


def key(i: int) -> Key:
    return make_key(i.to_bytes(8, "little"), 0)


def cache(pool: BlockPool, keys: list[Key]) -> list[int]:
    """Store one block per key and free them in order (the first is the next victim)."""
    block_ids = pool.allocate(len(keys))
    for k, block_id in zip(keys, block_ids, strict=True):
        pool.insert_key(k, block_id, 16)
    pool.free(block_ids)
    return block_ids


def free_keys(pool: BlockPool) -> list[Key | None]:
    """The free blocks' keys in eviction order (None: an unhashed block)."""
    return [pool.key(b) for b in pool.iter_free_after(None)]


def make(mode: CascadeMode, reserve: int = 2) -> tuple[BlockPool, BlockPool, Cascade]:
    cpu, disk = BlockPool(9), BlockPool(9)
    return cpu, disk, Cascade(cpu, disk, mode, reserve)


def finish(cascade: Cascade) -> list[Key]:
    """Complete every queued demotion successfully; return their keys."""
    items = cascade.take_queued()
    cascade.complete(items, succeeded=True, abandoned=False)
    return [item.key for item in items]


def test_write_back_demotes_exactly_the_next_reserve_victims() -> None:
    """Write-back copies the cached blocks among the CPU's next `reserve` victims, no more
    and no fewer, in victim order; once on disk they leave the CPU tier. (Unhashed free
    blocks, reused first, count among the victims: here the CPU tier has none.)"""
    cpu, disk, cascade = make(WB, reserve=3)
    cache(cpu, [key(i) for i in range(8)])
    cascade.select_write_back()
    assert finish(cascade) == [key(0), key(1), key(2)]
    assert [disk.cached_block(key(i)) is not None for i in range(8)] == [True] * 3 + [False] * 5
    assert [cpu.cached_block(key(i)) is not None for i in range(8)] == [False] * 3 + [True] * 5
    assert cascade.take_counters().num_demoted_blocks == 3
    cpu.check_invariants()
    disk.check_invariants()


def test_write_back_keeps_the_cpu_copy_of_a_block_in_use_when_its_demotion_lands() -> None:
    """A demoted block someone pinned meanwhile (a load) keeps its CPU copy."""
    cpu, _, cascade = make(WB, reserve=1)
    block_id = cache(cpu, [key(i) for i in range(8)])[0]
    cascade.select_write_back()
    items = cascade.take_queued()
    assert [item.key for item in items] == [key(0)]
    cpu.touch([block_id])  # a lookup pins it while the copy is in flight
    cascade.complete(items, succeeded=True, abandoned=False)
    assert cpu.cached_block(key(0)) == block_id
    cpu.free([block_id])
    cpu.check_invariants()


def test_a_key_whose_demotion_is_in_flight_is_not_demoted_again() -> None:
    """Write-through: a block reported stored twice before its copy lands moves once."""
    cpu, disk, cascade = make(WT)
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cascade.after_stores([block_id])
    cascade.after_stores([block_id])
    assert [item.key for item in cascade.take_queued()] == [key(0)]
    assert disk.num_free() == disk.num_usable_blocks - 1


def test_a_demotion_registers_every_key_of_the_block_on_disk() -> None:
    """Secondary keys (other KV groups' views of the block) go to disk with the primary."""
    cpu, disk, cascade = make(WT)
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cpu.insert_key(key(1), block_id, 16)
    cascade.after_stores([block_id])
    finish(cascade)
    assert disk.cached_block(key(0)) is not None
    assert disk.cached_block(key(0)) == disk.cached_block(key(1))


def test_write_through_cpu_hits_refresh_the_disk_copies_tail_first() -> None:
    """A CPU load moves the blocks' disk copies to the disk's MRU end, last position
    first, so the disk keeps what the CPU keeps hot and evicts a prefix's tail first."""
    cpu, disk, cascade = make(WT)
    keys = [key(i) for i in range(4)]
    cpu_ids = cache(cpu, keys)
    cache(disk, keys)
    cascade.after_cpu_loads(cpu_ids[:2])  # a request hit keys 0 and 1 in the CPU
    assert free_keys(disk)[-4:] == [key(2), key(3), key(1), key(0)]
    assert cascade.take_queued() == []


def test_write_through_store_of_a_key_on_disk_refreshes_the_copy_and_moves_nothing() -> None:
    """A block stored into the CPU that the disk already holds (a promotion) is not
    copied again; its disk copy becomes most recently used."""
    cpu, disk, cascade = make(WT)
    cache(disk, [key(0), key(1)])
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cascade.after_stores([block_id])
    assert cascade.take_queued() == []
    assert free_keys(disk)[-2:] == [key(1), key(0)]


def test_a_demotion_whose_cpu_copy_was_discarded_meanwhile_registers_nothing() -> None:
    """A failed load drops the CPU copy's keys while its demotion is in flight: the bytes
    read are suspect, so the disk copy is not registered (lost, never corrupt)."""
    cpu, disk, cascade = make(WT)
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cascade.after_stores([block_id])
    cpu.discard_keys(block_id)
    finish(cascade)
    assert disk.cached_block(key(0)) is None
    assert disk.num_free() == disk.num_usable_blocks
    cpu.free([block_id])
    cpu.check_invariants()
    disk.check_invariants()


def test_a_finished_demotion_frees_the_disk_copies_tail_first() -> None:
    """A request's blocks, demoted together in position order, enter the disk's order
    last position first (SPEC §4): the root is the most recently used."""
    cpu, disk, cascade = make(WT)
    block_ids = cpu.allocate(2)
    for i, block_id in enumerate(block_ids):
        cpu.insert_key(key(i), block_id, 16)
    cascade.after_stores(block_ids)
    assert finish(cascade) == [key(0), key(1)]
    assert free_keys(disk)[-2:] == [key(1), key(0)]


def test_no_free_disk_slot_drops_the_demotion_and_counts_it() -> None:
    """With every disk block pinned, a demotion is dropped (counted), nothing allocated."""
    cpu, disk, cascade = make(WT)
    pinned = disk.allocate(disk.num_usable_blocks)
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cascade.after_stores([block_id])
    assert cascade.take_queued() == []
    assert cascade.take_counters().num_dropped_demotions == 1
    disk.free(pinned)
    cpu.free([block_id])
    cpu.check_invariants()


def test_a_write_back_victim_waiting_for_a_disk_slot_is_dropped_once() -> None:
    """Write-back retries its next victims every step while no disk slot is free: each
    counts once as a dropped demotion, and again only after it left the CPU tier."""
    cpu, disk, cascade = make(WB, reserve=2)
    pinned = disk.allocate(disk.num_usable_blocks)
    cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])  # no unhashed victims
    for _ in range(3):
        cascade.select_write_back()
    assert cascade.take_queued() == []
    assert cascade.take_counters().num_dropped_demotions == 2  # key 0 and key 1, once each
    cpu.allocate(1)  # evicts key 0: its drop is forgotten with it
    cascade.select_write_back()
    assert cascade.take_counters().num_dropped_demotions == 1  # key 2, now a next victim
    assert {k for _, k in cascade.dropped} == {key(1), key(2)}
    disk.free(pinned[:1])
    cascade.select_write_back()  # one slot: key 1 goes, key 2 is still dropped
    assert [item.key for item in cascade.take_queued()] == [key(1)]
    assert cascade.take_counters().num_dropped_demotions == 0
    assert {k for _, k in cascade.dropped} == {key(2)}
    cpu.check_invariants()


def test_a_failed_demotion_can_be_tried_again() -> None:
    """A finished (here failed) demotion forgets its key: the next store copies it again."""
    cpu, _, cascade = make(WT)
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cascade.after_stores([block_id])
    cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)
    assert cascade.take_counters().num_failed_demotions == 1
    cascade.after_stores([block_id])
    assert [item.key for item in cascade.take_queued()] == [key(0)]


def test_write_through_selects_no_victims() -> None:
    """Victim selection is write-back's: under write-through it neither demotes nor
    refreshes the disk copies of the CPU's next victims."""
    cpu, disk, cascade = make(WT)
    keys = [key(i) for i in range(8)]
    cache(cpu, keys)
    cache(disk, keys)  # the CPU victims (keys 0, 1) are the disk's too
    before = free_keys(disk)
    cascade.select_write_back()
    assert cascade.take_queued() == []
    assert free_keys(disk) == before


def test_write_back_with_arc_evicts_the_demoted_block_as_arc_would() -> None:
    """The demotion's pin is no hit (`BlockPool.pin`) and its end is an eviction
    (`BlockPool.evict_keys`): ARC keeps the key as a B1 ghost (T1's), so storing it
    again adapts `p`. Before, the pin's `touch` sent the block to T2 and `discard_keys`
    left no ghost. A failed demotion frees the block again, at T1's recent end."""
    policy = ARCPolicy(9)
    cpu, disk = BlockPool(9, free_queue=policy), BlockPool(9)
    cascade = Cascade(cpu, disk, WB, reserve=1)
    for i in range(8):
        (block_id,) = cpu.allocate(1)
        cpu.insert_key(key(i), block_id, 16)
        cpu.free([block_id])
    cascade.select_write_back()
    failed = cascade.take_queued()
    cascade.complete(failed, succeeded=False, abandoned=False)
    assert free_keys(cpu) == [key(i) for i in (*range(1, 8), 0)]
    cascade.select_write_back()
    assert finish(cascade) == [key(1)]
    assert cpu.cached_block(key(1)) is None
    assert disk.cached_block(key(1)) is not None
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(1), block_id, 16)  # stored again (a promotion): a B1 ghost hit
    assert policy.target_t1 == 1.0
    cpu.free([block_id])
    cpu.check_invariants()


def cpu_hits(policy: str, ids: list[int], cascade: bool) -> int:
    """One-block requests through a 6-block CPU tier, with or without write-back behind
    it (reserve 1, every demotion completed before the allocation it makes room for)."""
    cpu = BlockPool(7, free_queue=EVICTION_POLICIES[policy](7))
    demote = Cascade(cpu, BlockPool(25), WB, reserve=1) if cascade else None
    hits = 0
    for i in ids:
        block_id = cpu.cached_block(key(i))
        if block_id is not None:
            cpu.touch([block_id])
            cpu.free([block_id])
            hits += 1
            continue
        if demote is not None:
            demote.select_write_back()
            finish(demote)
        (block_id,) = cpu.allocate(1)
        cpu.insert_key(key(i), block_id, 16)
        cpu.free([block_id])
        cpu.check_invariants()
    return hits


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("seed", range(3))
def test_write_back_leaves_the_cpu_tier_hitting_as_it_would_alone(policy: str, seed: int) -> None:
    """A demotion's pin is no hit and its end is the policy's own eviction of the block
    (`pin`, `release_evicted`): the CPU tier hits exactly as with no disk behind it.
    Before, with ARC 28 of 30 such traces differed (-485 hits in all), LFU-DA +596."""
    rng = random.Random(seed)
    ids = [rng.randrange(12) if rng.random() < 0.6 else 100 + n for n in range(400)]
    assert cpu_hits(policy, ids, cascade=True) == cpu_hits(policy, ids, cascade=False)


def test_write_back_victims_enter_the_disk_order_oldest_first() -> None:
    """A prefix freed tail first in the CPU tier (its tail the next victim) keeps that
    order on disk once demoted together: the disk evicts its tail before its root, as
    the replay's cascade models it (docs/policies.md). Regression: the batch was freed
    reversed, so the root became the disk's least recently used block."""
    cpu, disk, cascade = make(WB, reserve=3)
    block_ids = cpu.allocate(8)
    for i, block_id in enumerate(block_ids):
        cpu.insert_key(key(i), block_id, 16)
    cpu.free(block_ids[::-1])  # tail first: key 7 is the next victim, key 0 the last
    cascade.select_write_back()
    assert finish(cascade) == [key(7), key(6), key(5)]
    assert free_keys(disk)[-3:] == [key(7), key(6), key(5)]
    cpu.check_invariants()
    disk.check_invariants()
