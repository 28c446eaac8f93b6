"""The cascade with the token check on (SPEC §3 and §7 Beyond): a disk copy of a key that
the check cannot serve (restored from a manifest written without the check, or holding
another tag) does not count as the CPU copy's disk copy. The tagged CPU copy is demoted
and replaces it.

Regression: a key restored without a tag (or with another one) counted as already on
disk, so neither write-through nor write-back demoted the tagged CPU copy; once the CPU
tier evicted it, every lookup of the prefix missed.
"""

from __future__ import annotations

import pytest
from sim import Admission, SimEngine, make_request
from test_scenarios_cascade import cascade_engine, keys_of
from test_token_check import expected_tags

from kvtier.core.block_pool import BlockPool
from kvtier.offload.cascade import Cascade
from kvtier.offload.config import CascadeMode
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.plan import SlotRecord, Tier

WT, WB = CascadeMode.WRITE_THROUGH, CascadeMode.WRITE_BACK
OTHER = b"o" * 16


def restored_disk(mode: CascadeMode, num_cpu: int, tag: bytes | None) -> SimEngine:
    """A cascade engine whose disk restored request "a"'s 2 blocks with `tag`."""
    engine = cascade_engine(mode, num_cpu=num_cpu, num_disk=12, token_check=True)
    records = [(slot, SlotRecord(k, 4, tag)) for slot, k in enumerate(keys_of(range(8), 2), 1)]
    assert engine.scheduler.restore(Tier.DISK, records) == 2
    return engine


def disk_tags(engine: SimEngine) -> list[bytes | None]:
    disk = engine.scheduler.index.pools[Tier.DISK]
    slots = [disk.cached_blocks(k) for k in keys_of(range(8), 2)]
    assert all(len(s) == 1 for s in slots), f"a key held by several disk blocks: {slots}"
    return [disk.tag(s[0]) for s in slots]


@pytest.mark.parametrize("tag", [None, OTHER])
def test_write_through_replaces_a_restored_disk_copy_the_check_cannot_serve(
    tag: bytes | None,
) -> None:
    engine = restored_disk(WT, num_cpu=5, tag=tag)
    engine.run(make_request("a", range(8)))
    engine.drain()
    assert disk_tags(engine) == expected_tags(list(range(8)))
    assert engine.scheduler.take_stats().num_demoted_blocks == 2
    engine.run(make_request("b", range(200, 216)))  # evicts "a" from the CPU tier
    engine.drain()
    engine.evict_gpu()
    assert engine.admit(make_request("c", [*range(8), 5])) == Admission(0, 8, 8)  # from disk
    engine.drain()
    engine.check()


@pytest.mark.parametrize("tag", [None, OTHER])
def test_write_back_demotes_a_tagged_cpu_copy_over_a_restored_one(tag: bytes | None) -> None:
    engine = restored_disk(WB, num_cpu=9, tag=tag)
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.run(make_request("b", range(200, 224)))  # "a" reaches the reserve window
    for _ in range(3):
        engine.step()
    engine.drain()
    assert disk_tags(engine) == expected_tags(list(range(8)))
    stats = engine.scheduler.take_stats()
    assert stats.num_demoted_blocks == 2
    assert stats.num_lost_blocks == 0
    engine.evict_gpu()
    assert engine.admit(make_request("c", [*range(8), 5])) == Admission(0, 8, 8)
    engine.drain()
    engine.check()


def test_a_disk_copy_with_the_cpu_copys_tag_is_kept_and_an_untagged_cpu_copy_replaces_none() -> (
    None
):
    """Only a tagged CPU copy replaces a disk copy, and only one with another tag; a
    persistent tier's manifest drops the replaced copy's record too."""
    cpu, disk = BlockPool(9), BlockPool(9)
    dropped = DroppedSlots(active=True)
    cascade = Cascade(cpu, disk, WT, reserve=2, dropped=dropped)
    keys = keys_of(range(12), 3)
    for slot, (k, tag) in enumerate(zip(keys, [b"a" * 16, None, OTHER], strict=True), 1):
        disk.touch([slot])
        disk.insert_key(k, slot, 4, tag=tag)
        disk.free([slot])
    block_ids = cpu.allocate(3)
    for k, block_id, tag in zip(keys, block_ids, [b"a" * 16, None, b"c" * 16], strict=True):
        cpu.insert_key(k, block_id, 4, tag=tag)
    cascade.after_stores(block_ids)
    items = cascade.take_queued()
    assert [item.key for item in items] == [keys[2]]  # same tag: kept; untagged: no gain
    cascade.complete(items, succeeded=True, abandoned=False)
    assert disk.cached_blocks(keys[2]) == [items[0].disk_block_id]
    assert disk.tag(items[0].disk_block_id) == b"c" * 16
    assert disk.key(3) is None  # the replaced copy is gone, its tag with it
    assert disk.tag(3) is None
    assert dropped.take() == (3,)  # a restart must not restore the replaced copy
    cpu.free(block_ids)
    cpu.check_invariants()
    disk.check_invariants()


def test_a_restored_tagged_copy_is_served_before_an_untagged_copy_of_its_key() -> None:
    """A manifest holds both an untagged copy of a key (a run without the check) and the
    tagged one a checking run stored since, at a higher slot: the tagged one is served.

    Regression: restore indexed by slot order, so the untagged copy was the key's first
    block, the only one a lookup checks: a miss at every restart. The untagged copies are
    not indexed at all, and the first plan drops their records (before, every restart
    restored them again: 4 blocks here)."""
    engine = cascade_engine(WT, num_cpu=5, num_disk=12, token_check=True, disk_persist=True)
    keys = keys_of(range(8), 2)
    stale = [(slot, SlotRecord(k, 4, None)) for slot, k in enumerate(keys, 1)]
    fresh = [
        (slot, SlotRecord(k, 4, tag))
        for slot, k, tag in zip([5, 6], keys, expected_tags(list(range(8))), strict=True)
    ]
    assert engine.scheduler.restore(Tier.DISK, stale + fresh) == 2
    assert engine.step().forget_slots == (1, 2)
    assert engine.admit(make_request("c", [*range(8), 5])) == Admission(0, 8, 8)
    engine.drain()
    engine.check()


def test_a_tagged_demotion_drops_only_the_secondary_key_of_another_block() -> None:
    """A disk block holds the demoted key as a secondary key (no tag) beside its own
    primary key: only that secondary key goes, the block's own copy stays.

    Regression: `_register` discarded every key of the block, its good primary copy too."""
    cpu, disk = BlockPool(9), BlockPool(9)
    cascade = Cascade(cpu, disk, WT, reserve=2)
    own, shared = keys_of(range(8), 2)
    disk.touch([1])
    disk.insert_key(own, 1, 4, tag=b"a" * 16)
    disk.insert_key(shared, 1, 4)  # secondary
    disk.free([1])
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(shared, block_id, 4, tag=b"c" * 16)
    cascade.after_stores([block_id])
    items = cascade.take_queued()
    assert [item.key for item in items] == [shared]
    cascade.complete(items, succeeded=True, abandoned=False)
    assert disk.cached_blocks(own) == [1]
    assert disk.tag(1) == b"a" * 16
    assert disk.secondary_keys(1) == ()
    assert disk.cached_blocks(shared) == [items[0].disk_block_id]
    cpu.free([block_id])
    cpu.check_invariants()
    disk.check_invariants()


def test_a_store_over_a_disk_copy_the_check_cannot_serve_is_no_promotion() -> None:
    """A request computes a prefix whose restored disk copies (no tag) the check cannot
    serve: its stores into the CPU tier are not promotions. Loaded from tagged disk
    copies later, the prefix's stores are.

    Regression: every store of a key the disk held counted as a promotion (2 here)."""
    engine = restored_disk(WT, num_cpu=5, tag=None)
    assert engine.run(make_request("a", range(8))).num_accepted_tokens == 0
    engine.drain()
    assert engine.scheduler.take_stats().num_promoted_blocks == 0
    engine.run(make_request("b", range(200, 216)))  # evicts "a" from the CPU tier
    engine.drain()
    engine.evict_gpu()
    assert engine.run(make_request("c", [*range(8), 5])).num_accepted_tokens == 8
    engine.drain()
    engine.check()
    assert engine.scheduler.take_stats().num_promoted_blocks == 2


def test_a_persistent_tiers_demotion_records_carry_the_cpu_copys_tags() -> None:
    """A persistent disk's slot records keep each demoted copy's token tag: a restart
    restores it tagged, and the check serves it (a mutant recorded no tag: the restored
    copies were never served, a miss at every restart)."""
    engine = cascade_engine(WT, num_cpu=5, num_disk=12, token_check=True, disk_persist=True)
    engine.run(make_request("a", range(8)))
    engine.drain()
    (demotion,) = [
        job
        for plan in engine.worker.plans
        for job in plan.jobs
        if (job.src_tier, job.dst_tier) == (Tier.CPU, Tier.DISK)
    ]
    assert [r.tag for r in demotion.dst_records] == expected_tags(list(range(8)))
    engine.check()
