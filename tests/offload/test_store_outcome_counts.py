"""Store outcomes of blocks a full tier stops at (SPEC §6.10): eager and lazy mode retry
them and count each once as `deferred_tier_full`; a finished request's are dropped, each
counted, and never offered to the admission policy or noted for the token check."""

from __future__ import annotations

import pytest
from sim import SimEngine, block_key, config, full_layout, make_request
from test_cascade_demotions import WB, cache, key, make

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode


def fill_tier(engine: SimEngine) -> list[int]:
    """Pin every free tier slot (as stores in flight would); return them."""
    tier = engine.scheduler.tier_pool
    return tier.allocate(tier.num_free())


@pytest.mark.parametrize("events", [False, True], ids=["batched", "per-block"])
def test_a_finish_at_a_full_tier_drops_each_block_without_offering_it(events: bool) -> None:
    """The finish flush counts every block it could not store, and the `door` filter sees
    none of them: a later request is admitted exactly as if they were never there."""
    outcomes = []
    for finish_at_full in (False, True):
        engine = SimEngine(
            full_layout(), config(admission_policy="door", events=events), num_tier_blocks=3
        )
        engine.run(make_request("p", range(4)))  # block 0 seen once
        engine.drain()
        engine.evict_gpu()
        if finish_at_full:
            pinned = fill_tier(engine)
            engine.scheduler.take_stats()
            engine.run(make_request("a", range(16)))
            assert engine.scheduler.take_stats().store_outcomes == {"dropped_tier_full": 4}
            engine.scheduler.tier_pool.free(pinned)
            engine.evict_gpu()
        engine.scheduler.take_stats()
        engine.run(make_request("c", range(16)))
        engine.drain()
        outcomes.append(engine.scheduler.take_stats().store_outcomes)
        engine.check()
    assert outcomes[0] == outcomes[1] == {"stored": 1, "dropped_not_admitted": 3}


def test_a_finish_at_a_full_tier_notes_no_tags_of_the_blocks_it_never_offered() -> None:
    """With the token check on, the blocks a full tier stopped the finish walk at are not
    noted: a later request sharing them on the GPU stores what it could before."""
    engine = SimEngine(full_layout(), config(token_check=True), num_tier_blocks=5)
    pinned = fill_tier(engine)
    engine.run(make_request("a", range(16)))
    engine.scheduler.tier_pool.free(pinned)
    engine.scheduler.take_stats()
    engine.run(make_request("b", [*range(16), 99]))  # a 16-token local hit on the GPU
    engine.drain()
    outcomes = engine.scheduler.take_stats().store_outcomes
    assert outcomes == {"stored": 1, "skipped_no_token_tag": 3}
    engine.check()


def test_a_lazy_walk_counts_a_reused_gpu_block_as_deferred_again() -> None:
    """Lazy mode remembers the blocks it counted as deferred only until a request uses
    them: a reused block holds another key, a new candidate that counts once more."""
    cfg = config(store_mode=StoreMode.LAZY, max_batched_tokens=4)
    engine = SimEngine(full_layout(), cfg, num_gpu_blocks=2, num_tier_blocks=3)
    fill_tier(engine)
    counts = []
    for name, first in (("a", 0), ("b", 100)):
        engine.run(make_request(name, range(first, first + 4)))  # the one usable GPU block
        engine.scheduler.take_stats()
        engine.step()
        engine.step()
        counts.append(engine.scheduler.take_stats().store_outcomes)
    assert counts == [{"deferred_tier_full": 1}] * 2


def test_a_dropped_demotion_counts_again_once_its_key_came_back() -> None:
    """Write-back: a key discarded from the CPU tier (as a failed load does) and stored
    again is a new victim; finding the disk full again counts it again."""
    cpu, disk, cascade = make(WB, reserve=1)
    pinned = disk.allocate(disk.num_usable_blocks)
    blocks = cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    cascade.select_write_back()
    cascade.select_write_back()
    assert cascade.take_counters().num_dropped_demotions == 1
    cascade.before_cpu_discard(blocks[0])  # as a failed load of the block does
    cpu.discard_keys(blocks[0])  # key 0 leaves without an eviction
    (again,) = cpu.allocate(1)  # the unhashed block 0 is the next victim: reused
    cpu.insert_key(key(0), again, 16)
    cpu.free([again])
    for block_id in list(cpu.iter_free_after(None))[:-1]:  # make key 0 the next victim
        cpu.touch([block_id])
        cpu.free([block_id])
    cascade.select_write_back()
    assert cascade.take_counters().num_dropped_demotions == 1
    disk.free(pinned)
    cpu.check_invariants()


def test_a_finish_at_a_full_tier_counts_a_window_null_the_gpu_evicted_as_null() -> None:
    """SPEC §6.10: a finished request's blocks a full tier leaves are dropped, each
    counted once: a window's null position whose block the GPU cache still holds needed
    a slot (`dropped_tier_full`), one whose block is gone had nothing to store
    (`dropped_null`), also past the position the full tier stopped at."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4),
        )
    )
    engine = SimEngine(layout, num_gpu_blocks=24, num_tier_blocks=16)
    a = make_request("a", range(12))
    assert engine.admit(a) is not None
    engine.schedule("a")
    engine.step()  # computed: nothing selected yet (eager selects confirmed blocks)
    window = list(engine.tables["a"][1])
    engine.drop_blocks("a", 1, [0, 1])  # out of the window: null in the table
    engine.gpu.discard_keys(window[1])  # the GPU cache evicted position 1's block
    assert engine.gpu.cached_block(block_key(layout, a, 1, 0)) == window[0]
    assert engine.gpu.cached_block(block_key(layout, a, 1, 1)) is None
    fill_tier(engine)
    engine.scheduler.take_stats()
    engine.finish("a")
    assert engine.step().jobs == ()
    outcomes = engine.scheduler.take_stats().store_outcomes
    assert outcomes == {"dropped_tier_full": 5, "dropped_null": 1}
