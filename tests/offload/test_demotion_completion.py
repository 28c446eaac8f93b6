"""What a CPU → DISK demotion's report does (`offload/demotion_completion.py`): one
that registers nothing leaves no manifest record behind, and one abandoned at a reset
lets go of nothing a later demotion of its key holds."""

from __future__ import annotations

from sim import SimEngine, make_request
from test_cascade_demotions import key
from test_scenarios_cascade import cascade_engine, next_job

from kvtier.core.block_pool import BlockPool
from kvtier.offload.cascade import Cascade
from kvtier.offload.config import CascadeMode
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.plan import Tier, TransferJob


def abandoned_demotion() -> tuple[SimEngine, TransferJob]:
    """Return a write-through engine whose reset abandoned a's CPU -> DISK demotion, and
    that demotion's job, still in flight (the worker completes nothing by itself)."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=9, num_disk=12)
    engine.auto_complete = False
    engine.run(make_request("a", range(300, 308)))
    engine.worker.complete(next_job(engine, Tier.GPU, Tier.CPU).event_id)
    engine.poll()
    old = next_job(engine, Tier.CPU, Tier.DISK)  # left in flight
    assert engine.scheduler.reset() is False
    return engine, old


def test_a_demotion_that_registers_nothing_names_its_slot_for_the_manifest() -> None:
    """Every worker wrote the disk copy, but a failed load dropped the CPU copy's keys
    while it moved (its bytes are suspect): nothing is registered, and the workers'
    record of the slot must go with the next plan, or a restart of a persistent tier
    restores the suspect bytes under the key (a mutant named no slot: () == (1,))."""
    cpu, disk = BlockPool(9), BlockPool(9)
    dropped = DroppedSlots(active=True)
    cascade = Cascade(cpu, disk, CascadeMode.WRITE_THROUGH, reserve=2, dropped=dropped)
    (block_id,) = cpu.allocate(1)
    cpu.insert_key(key(0), block_id, 16)
    cascade.after_stores([block_id])
    (item,) = cascade.take_queued()
    cpu.discard_keys(block_id)  # a failed load of the block
    cascade.complete([item], succeeded=True, abandoned=False)
    assert disk.cached_block(key(0)) is None
    assert dropped.take() == (item.disk_block_id,)
    cpu.free([block_id])
    cpu.check_invariants()
    disk.check_invariants()


def test_an_abandoned_demotions_report_keeps_a_later_demotion_of_its_key_in_flight() -> None:
    """A reset abandons a's demotion in flight and lets its key go; b stores the same
    prompt and demotes it again. The abandoned move's report must not take that key
    out of the in-flight demotions (a mutant did: the invariant check failed, and a
    third copy of the key could have been issued beside b's)."""
    engine, old = abandoned_demotion()
    engine.evict_gpu()
    engine.run(make_request("b", range(300, 308)))
    engine.worker.complete(next_job(engine, Tier.GPU, Tier.CPU).event_id)
    engine.poll()
    new = next_job(engine, Tier.CPU, Tier.DISK)
    assert len(new.src_block_ids) == len(old.src_block_ids) == 2  # a's two keys again
    engine.worker.complete(old.event_id)
    engine.poll()
    engine.check()
    engine.worker.complete(new.event_id)
    engine.poll()
    engine.check()
    assert engine.scheduler.reset() is True
