"""The token check on a disk-only tier: a tagged store replaces a copy of its key that
carries no tag (restored from a run without the check), which the check never serves.

Regression: the store was skipped as "already cached", so the key missed for good, in
this run and every checking restart (its untagged record stayed in the manifest)."""

from __future__ import annotations

import pytest
from sim import Admission, SimEngine, full_layout, make_request
from test_scenarios_cascade import keys_of

from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import SlotRecord, Tier
from kvtier.offload.scheduler import OffloadScheduler

MIB = 1 << 20


def disk_engine(persist: bool = True, events: bool = False) -> SimEngine:
    """A disk-only tier of 8 blocks with the token check (eager stores: lazy ones
    cannot be checked)."""
    config = OffloadConfig(
        disk_bytes=MIB,
        disk_path="unused-by-the-fake-worker",
        disk_persist=persist,
        token_check=True,
        events=events,
    )
    return SimEngine(full_layout(), config, num_gpu_blocks=16, num_tier_blocks=8)


def forgotten(engine: SimEngine) -> list[int]:
    return [slot for plan in engine.worker.plans for slot in plan.forget_slots]


def tags(scheduler: OffloadScheduler, keys: list[bytes]) -> list[bytes | None]:
    pool = scheduler.tier_pool
    blocks = [pool.cached_block(key) for key in keys]
    return [None if b is None else pool.tag(b, key) for b, key in zip(blocks, keys, strict=True)]


@pytest.mark.parametrize("events", [False, True])  # True: block by block (`try_select`)
def test_a_tagged_store_replaces_a_restored_untagged_copy(events: bool) -> None:
    engine = disk_engine(events=events)
    keys = keys_of(range(8), 2)
    untagged = [(1, SlotRecord(keys[0], 4)), (2, SlotRecord(keys[1], 4))]
    assert engine.scheduler.restore(Tier.DISK, untagged) == 2
    assert engine.admit(make_request("probe", [*range(8), 9])) == Admission(0, 0, 0)
    engine.finish("probe")
    engine.run(make_request("a", [*range(8), 9]))
    engine.drain()
    assert None not in tags(engine.scheduler, keys)  # the tagged copies replaced them
    assert sorted(forgotten(engine)) == [1, 2]  # their records go (before the stores ran)
    engine.evict_gpu()
    assert engine.admit(make_request("b", [*range(8), 9])) == Admission(0, 8, 8)
    engine.step()
    engine.check()


def test_a_tagged_copy_is_kept_and_a_non_persistent_tier_drops_no_records() -> None:
    engine = disk_engine(persist=False)
    engine.run(make_request("a", [*range(8), 9]))
    engine.drain()
    keys = keys_of(range(8), 2)
    before = tags(engine.scheduler, keys)
    assert None not in before
    engine.evict_gpu()
    engine.run(make_request("b", [*range(8), 9]))  # a hit: nothing to store again
    engine.drain()
    assert tags(engine.scheduler, keys) == before
    assert forgotten(engine) == []
    engine.check()


def test_a_store_of_a_key_with_a_tagged_copy_replaces_nothing() -> None:
    """b skips the prefix cache (no hit: it computes the whole prompt) and stores
    nothing of it: the tagged copies are served as they are, and kept (a mutant replaced
    them too: new slots, the old ones' records dropped)."""
    engine = disk_engine()
    engine.run(make_request("a", [*range(8), 9]))
    engine.drain()
    keys = keys_of(range(8), 2)
    slots = [engine.scheduler.tier_pool.cached_block(key) for key in keys]
    engine.scheduler.take_stats()
    engine.run(make_request("b", [*range(8), 9], skip_prefix_cache=True))
    engine.drain()
    assert engine.scheduler.take_stats().store_outcomes == {"skipped_already_cached": 2}
    assert [engine.scheduler.tier_pool.cached_block(key) for key in keys] == slots
    assert forgotten(engine) == []
    engine.check()
