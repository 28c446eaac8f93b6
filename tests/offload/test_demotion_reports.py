"""What a CPU → DISK demotion's report registers, counts and frees
(`offload/demotion_completion.py`): demotions let go of unissued register and count
nothing, a failed one names its slot for a persistent tier's manifest, a secondary key's
disk event is its own, and a report a reset abandoned frees its slots and says nothing
about the disk now."""

from __future__ import annotations

import pytest
from sim import SimEngine, make_request
from test_cascade_demotions import WT, key
from test_demotion_completion import abandoned_demotion
from test_scenarios_cascade import cascade_engine, next_job

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, key_block_hash
from kvtier.offload.cascade import Cascade
from kvtier.offload.config import CascadeMode
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.plan import Tier


def test_demotions_released_unissued_register_and_count_nothing() -> None:
    """A reset lets go of queued demotions: no key reaches the disk, no demotion is
    counted (a mutant registered them: one demoted block; another counted them as
    failed), and every slot and pin goes back."""
    cpu, disk = BlockPool(9), BlockPool(9)
    cascade = Cascade(cpu, disk, WT, reserve=2)
    block_ids = cpu.allocate(2)
    for i, block_id in enumerate(block_ids):
        cpu.insert_key(key(i), block_id, 16)
    cascade.after_stores(block_ids)
    cascade.release(cascade.take_queued())
    assert [disk.cached_block(key(i)) for i in range(2)] == [None, None]
    assert disk.num_free() == 8
    assert [cpu.ref_count(b) for b in block_ids] == [1, 1]  # the store's own pins
    counters = cascade.take_counters()
    assert (counters.num_demoted_blocks, counters.num_failed_demotions) == (0, 0)
    assert not cascade.in_flight_keys


def test_a_failed_demotion_names_its_slots_for_the_manifest() -> None:
    """Another worker of the job may have written and recorded the slots: a persistent
    tier must drop those records with the next plan (a mutant named none: () ==
    (slot,)), or a restart restores whatever half-written bytes are there."""
    cpu, disk = BlockPool(9), BlockPool(9)
    dropped = DroppedSlots(active=True)
    cascade = Cascade(cpu, disk, WT, reserve=2, dropped=dropped)
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cascade.after_stores([block_id])
    (item,) = cascade.take_queued()
    cascade.complete([item], succeeded=False, abandoned=False)
    assert disk.cached_block(key(0)) is None
    assert dropped.take() == (item.disk_block_id,)


def test_a_secondary_keys_disk_event_is_its_own() -> None:
    """The disk event of a demoted block's secondary key (no payload kept) is made from
    that key with no token count, as a partial entry's; never the primary key's payload
    (mutants passed the primary's count: (k1, 16), or its payload: the hash of k0)."""
    calls: list[tuple[Key, int | None]] = []

    def event(k: Key, num_tokens: int | None) -> BlockStored:
        calls.append((k, num_tokens))
        return BlockStored(key_block_hash(k), 0, num_tokens or 4, medium="DISK")

    cpu = BlockPool(9, record_events=True, medium="CPU")
    disk = BlockPool(9, record_events=True, medium="DISK")
    cascade = Cascade(cpu, disk, WT, 2, event=event)
    (block_id,) = cpu.allocate(1)
    stored = BlockStored(key_block_hash(key(0)), 0, 16, medium="CPU", token_ids=(7,) * 16)
    cpu.insert_key(key(0), block_id, 16, stored)
    cpu.insert_key(key(1), block_id, 16)  # a secondary key, payload-free
    cascade.after_stores([block_id])
    cascade.complete(cascade.take_queued(), succeeded=True, abandoned=False)
    assert calls == [(key(0), 16), (key(1), None)]
    events = [e for e in disk.take_events() if isinstance(e, BlockStored)]
    assert [(e.block_hash, e.block_size, e.token_ids) for e in events] == [
        (key_block_hash(key(0)), 16, (7,) * 16),
        (key_block_hash(key(1)), 4, ()),
    ]


def test_an_abandoned_demotions_failure_frees_its_slots() -> None:
    """A reset frees the slots of the transfers it abandoned as they are reported; a
    failed one's are not set aside as suspects (a mutant held them: the reset's disk
    tier was a slot short until a later write succeeded)."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=9, num_disk=12)
    engine.auto_complete = False
    engine.run(make_request("a", range(300, 308)))
    engine.worker.complete(next_job(engine, Tier.GPU, Tier.CPU).event_id)
    engine.poll()
    old = next_job(engine, Tier.CPU, Tier.DISK)
    assert engine.scheduler.reset() is False
    engine.worker.fail(old.event_id)
    engine.poll()
    engine.check()
    cascade = engine.scheduler.cascade
    assert cascade is not None
    assert len(cascade.set_aside) == 0
    assert cascade.disk_pool.num_free() == 11
    assert engine.scheduler.reset() is True


def disk_jobs(engine: SimEngine) -> list[int]:
    """Step once, completing nothing; return the CPU blocks its CPU → DISK jobs read."""
    plan = engine.step()
    jobs = [job for job in plan.jobs if (job.src_tier, job.dst_tier) == (Tier.CPU, Tier.DISK)]
    return [block_id for job in jobs for block_id in job.src_block_ids]


@pytest.mark.parametrize("succeeded", [True, False])
def test_an_abandoned_demotions_report_says_nothing_about_the_disk_now(
    succeeded: bool,
) -> None:
    """a's demotion, issued before a reset, reports after b's demotion failed: it may
    have been written before the fault, so it neither shows the disk works (mutants
    retried b at once and gave b's suspect slots back) nor counts as a failure in a row
    (a mutant doubled b's back-off: no retry at the second plan)."""
    engine, old = abandoned_demotion()
    engine.run(make_request("b", range(400, 408)))
    engine.worker.complete(next_job(engine, Tier.GPU, Tier.CPU).event_id)
    engine.poll()
    new = next_job(engine, Tier.CPU, Tier.DISK)
    engine.worker.fail(new.event_id)
    engine.poll()
    cascade = engine.scheduler.cascade
    assert cascade is not None
    assert len(cascade.set_aside) == 2  # b's two slots: suspects
    if succeeded:
        engine.worker.complete(old.event_id)
    else:
        engine.worker.fail(old.event_id)
    engine.poll()
    engine.check()
    assert len(cascade.set_aside) == 2
    assert disk_jobs(engine) == []  # b's retry waits out its back-off of two plans
    assert sorted(disk_jobs(engine)) == sorted(new.src_block_ids)


def test_a_block_whose_keys_a_failed_load_dropped_is_not_given_up_by_its_failed_demotion() -> None:
    """Write-back: a failed load discards the victim's keys while its demotion moves,
    then the demotion fails. Stored again later under the same key, the block is a new
    victim and is demoted (a mutant gave up the pair all the same: nothing demoted)."""
    cpu, disk = BlockPool(2), BlockPool(9)  # one CPU block: the next victim
    cascade = Cascade(cpu, disk, CascadeMode.WRITE_BACK, reserve=1)
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cpu.free([block_id])
    cascade.select_write_back()
    (item,) = cascade.take_queued()
    cascade.before_cpu_discard(block_id)  # a failed load of the block
    cpu.discard_keys(block_id)
    cascade.complete([item], succeeded=False, abandoned=False)
    assert cpu.allocate(1) == [block_id]  # unhashed: reused first
    cpu.insert_key(key(0), block_id, 16)
    cpu.free([block_id])
    cascade.select_write_back()
    assert [(i.cpu_block_id, i.key) for i in cascade.take_queued()] == [(block_id, key(0))]
    cpu.check_invariants()
    disk.check_invariants()


def test_an_untagged_demotion_keeps_another_blocks_copy_of_its_key() -> None:
    """Two CPU blocks demote at once: b2 holds k0 as a secondary key, b1 as its primary
    key. b2's lands first, so the disk holds k0 when b1's lands: with no tag (the token
    check off) every copy serves, and b2's stays beside b1's (a mutant dropped it, so
    evicting b1's disk copy would lose k0 though b2's slot still held it)."""
    cpu, disk = BlockPool(9), BlockPool(9)
    cascade = Cascade(cpu, disk, WT, reserve=2)
    b1, b2 = cpu.allocate(2)
    cpu.insert_key(key(0), b1, 16)
    cpu.insert_key(key(1), b2, 16)
    cpu.insert_key(key(0), b2, 16)  # secondary
    cascade.after_stores([b2])
    cascade.after_stores([b1])
    second, first = cascade.take_queued()
    assert (second.key, first.key) == (key(1), key(0))
    cascade.complete([second], succeeded=True, abandoned=False)
    cascade.complete([first], succeeded=True, abandoned=False)
    assert sorted(disk.cached_blocks(key(0))) == sorted([first.disk_block_id, second.disk_block_id])
    assert disk.secondary_keys(second.disk_block_id) == (key(0),)
    cpu.free([b1, b2])
    cpu.check_invariants()
    disk.check_invariants()
