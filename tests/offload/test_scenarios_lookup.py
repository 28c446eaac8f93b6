"""SPEC §9 scenarios 1-8: round trips and lookup."""

from __future__ import annotations

import logging

import pytest
from sim import (
    Admission,
    SimEngine,
    block_key,
    config,
    full_layout,
    make_request,
)

from kvtier.core.keys import key_block_hash, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode


def stored_engine(
    num_tokens: int = 8, tier_blocks: int = 8, num_gpu_blocks: int = 16, **kwargs: object
) -> SimEngine:
    """Return an engine whose tier holds request "a" (tokens 0..num_tokens-1), GPU evicted."""
    engine = SimEngine(
        full_layout(), config(**kwargs), num_gpu_blocks=num_gpu_blocks, num_tier_blocks=tier_blocks
    )
    engine.run(make_request("a", range(num_tokens)))
    engine.drain()
    engine.evict_gpu()
    return engine


def tier_slot(engine: SimEngine, request_tokens: list[int], pos: int) -> int | None:
    request = make_request("probe", request_tokens)
    return engine.scheduler.tier_pool.cached_block(block_key(engine.layout, request, 0, pos))


def tier_refs(engine: SimEngine) -> list[int]:
    pool = engine.scheduler.tier_pool
    return [pool.ref_count(b) for b in range(1, pool.num_blocks)]


def test_scenario_01_eager_round_trip_loads_the_right_slots_into_the_right_blocks() -> None:
    """Scenario 1: a finished 2-block request is stored; prompt + 1 token hits and loads both."""
    engine = SimEngine(full_layout(), num_gpu_blocks=8)
    engine.run(make_request("a", range(8)))
    engine.drain()
    (store,) = engine.worker.stores()
    assert store.num_blocks == 2
    engine.evict_gpu()

    b = make_request("b", [*range(8), 99])
    assert engine.admit(b) == Admission(0, 8, 8)
    plan = engine.step()
    (load,) = plan.jobs
    table = engine.tables["b"][0]
    assert load.is_load
    assert load.dst_block_ids == (table[0], table[1])
    assert load.src_block_ids == (
        tier_slot(engine, b.token_ids, 0),
        tier_slot(engine, b.token_ids, 1),
    )
    assert plan.load_request_ids == {load.event_id: ("b",)}
    assert "b" not in engine.loading  # the load finished; contents checked by poll()
    for pos in (0, 1):
        assert engine.worker.gpu[0][table[pos]] == block_key(engine.layout, b, 0, pos)
    engine.check()


def test_scenario_02_prompt_logprobs_request_gets_no_hit_and_leaves_no_pin() -> None:
    """Scenario 2: a request with skip_prefix_cache gets 0 external tokens and pins nothing."""
    engine = stored_engine()
    b = make_request("b", [*range(8), 99], skip_prefix_cache=True)
    assert engine.scheduler.lookup(b, 0) == 0
    assert tier_refs(engine) == [0] * 7
    assert engine.admit(b) == Admission(0, 0, 0)
    assert tier_refs(engine) == [0] * 7
    engine.check()


@pytest.mark.parametrize("events", [False, True])
def test_scenario_03_secondary_keys_are_registered_on_the_tier_copy(events: bool) -> None:
    """Scenario 3: a GPU block's secondary keys reach its tier copy; the primary key's
    token count is the GPU block's own (3 here, not the block size), with events on or off."""
    engine = SimEngine(full_layout(), config(events=events), num_gpu_blocks=8)
    a = make_request("a", range(8))
    engine.admit(a)
    engine.schedule("a")
    block = engine.tables["a"][0][1]
    primary = block_key(engine.layout, a, 0, 1)
    engine.gpu.insert_key(primary, block, 3)  # the engine's own count, kept by the forward
    engine.step()
    other = make_key(b"\x07" * 32, 0)
    engine.gpu.insert_key(other, block, 4)
    engine.scheduler.take_events()
    engine.finish("a")
    engine.drain()
    tier = engine.scheduler.tier_pool
    slot = tier.cached_block(primary)
    assert slot is not None
    assert tier.cached_block(other) == slot
    assert tier.key(slot) == primary
    assert tier.secondary_keys(slot) == (other,)
    assert tier.num_tokens(slot) == engine.gpu.num_tokens(block) == 3
    stored = [(e.block_hash, e.group_id) for e in engine.scheduler.take_events()]
    expected = [(a.block_hashes[0], 0), (a.block_hashes[1], 0), (key_block_hash(other), 0)]
    assert sorted(stored) == (sorted(expected) if events else [])
    engine.check()


def test_scenario_04_exact_two_block_prompt_hits_one_block() -> None:
    """Scenario 4: an exact 2-block prompt hits only 1 block: its last token is recomputed."""
    engine = stored_engine()
    b = make_request("b", range(8))
    assert engine.admit(b) == Admission(0, 4, 4)
    engine.step()
    assert engine.worker.loads()[-1].num_blocks == 1
    engine.check()


def test_scenario_05_lazy_stores_blocks_near_eviction_then_reloads_them() -> None:
    """Scenario 5: lazy mode stores freed GPU blocks near eviction; a later request loads them."""
    engine = SimEngine(
        full_layout(), config(store_mode=StoreMode.LAZY, max_batched_tokens=8), num_gpu_blocks=5
    )
    a = make_request("a", range(8))
    engine.run(a)
    assert engine.worker.stores() == []  # nothing is stored while the blocks are in use
    plan = engine.step()
    (store,) = plan.jobs
    assert sorted(store.src_block_ids) == sorted(engine.gpu.cached_block(k) for k in keys(a, 2))
    engine.evict_gpu()

    b = make_request("b", [*range(8), 99])
    assert engine.admit(b) == Admission(0, 8, 8)
    engine.step()
    assert engine.loading == {}
    engine.check_kv(b)
    engine.check()


def keys(request: object, num_blocks: int) -> list[bytes]:
    return [block_key(full_layout(), request, 0, pos) for pos in range(num_blocks)]  # type: ignore[arg-type]


def test_scenario_06_partial_acceptance_loads_only_accepted_positions() -> None:
    """Scenario 6: local hit 2 + tier offer 4, 2 accepted: loads go to GPU positions 2, 3 only."""
    engine = SimEngine(full_layout(), num_gpu_blocks=16)
    a = make_request("a", range(24))
    engine.run(a)
    engine.drain()
    a_keys = keys(a, 6)
    kept = [engine.gpu.cached_block(k) for k in a_keys[:2]]
    engine.gpu.touch(kept)  # keep only a's first two blocks cached on the GPU
    engine.evict_gpu()
    engine.gpu.free(kept[::-1])
    assert [engine.gpu.cached_block(k) is not None for k in a_keys] == [True] * 2 + [False] * 4

    b = make_request("b", [*range(24), 99])
    found = engine.lookup(b)
    assert (found.num_local_tokens, found.num_offered_tokens) == (8, 16)
    tier = engine.scheduler.tier_pool
    slots = [tier.cached_block(k) for k in a_keys]
    assert [tier.ref_count(s) for s in slots] == [0, 0, 1, 1, 1, 1]  # the hit is pinned
    assert engine.allocate(b, found, accept=8) == Admission(8, 16, 8)
    assert [tier.ref_count(s) for s in slots] == [0, 0, 1, 1, 0, 0]  # unused hit released
    plan = engine.step()
    (load,) = plan.jobs
    table = engine.tables["b"][0]
    assert load.dst_block_ids == (table[2], table[3])
    assert load.src_block_ids == (slots[2], slots[3])
    assert b.num_computed_tokens == 16
    engine.check_kv(b)
    engine.check()


def test_scenario_07_pinned_hit_survives_allocation_pressure() -> None:
    """Scenario 7: tier pressure between lookup and on_allocated cannot evict a pinned hit."""
    engine = stored_engine(tier_blocks=4)  # 3 usable slots; "a" holds 2
    b = make_request("b", [*range(8), 99])
    found = engine.lookup(b)
    assert found.num_offered_tokens == 8

    engine.scheduler.take_stats()
    engine.run(make_request("c", range(100, 112)))  # flushes 3 blocks into 1 free slot
    engine.drain()
    stats = engine.scheduler.take_stats()
    assert stats.store_outcomes == {"stored": 1, "dropped_tier_full": 2}  # each unstored block
    assert [tier_slot(engine, b.token_ids, pos) is not None for pos in (0, 1)] == [True, True]

    assert engine.allocate(b, found) == Admission(0, 8, 8)
    engine.step()
    assert engine.loading == {}
    engine.check_kv(b)
    engine.check()


@pytest.mark.parametrize("events", [False, True])
def test_a_full_tier_stops_the_cursor_and_the_block_is_stored_later(events: bool) -> None:
    """Scenario 12 / SPEC §6.5: with no free tier block, selection stops without advancing
    the cursor; the block is stored once a slot frees (events on: the per-block path)."""
    engine = SimEngine(full_layout(), config(events=events), num_tier_blocks=4)
    engine.auto_complete = False
    a = make_request("a", range(16), outputs=[1, 2, 3, 4])
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    table = engine.tables["a"][0]
    engine.scheduler.take_stats()
    engine.schedule("a")
    (store,) = engine.step().jobs  # 3 usable slots: blocks 0..2, block 3 waits
    assert store.src_block_ids == tuple(table[:3])
    engine.schedule("a")
    assert engine.step().jobs == ()  # the 3 slots are still being written
    stats = engine.scheduler.take_stats()
    assert stats.store_outcomes == {"stored": 3, "deferred_tier_full": 1}  # once, not per step
    engine.schedule("a")
    assert engine.step().jobs == ()
    assert engine.scheduler.take_stats().store_outcomes == {}  # still waiting: not again
    engine.worker.complete(store.event_id)
    engine.poll()
    engine.schedule("a")
    (store,) = engine.step().jobs
    assert store.src_block_ids == (table[3],)
    engine.worker.complete(store.event_id)
    engine.poll()
    assert engine.tier_content(block_key(engine.layout, a, 0, 3)) == [
        block_key(engine.layout, a, 0, 3)
    ]
    engine.check()


def test_scenario_08_misaligned_local_prefix_gets_no_hit_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Scenario 8: a local prefix off the scheduler block gets 0 external tokens, warned once."""
    groups = (
        KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
        KVGroupSpec(GroupKind.FULL_ATTENTION, 8, 64),
    )
    engine = SimEngine(KVLayout(groups), num_gpu_blocks=16)
    engine.run(make_request("a", range(16)))
    engine.drain()
    engine.evict_gpu()
    b = make_request("b", [*range(16), 99])
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.load_planner"):
        assert engine.scheduler.lookup(b, 4) == 0
        assert engine.scheduler.lookup(b, 12) == 0
    assert len([r for r in caplog.records if "scheduler block" in r.getMessage()]) == 1
    assert all(ref == 0 for ref in tier_refs(engine))
    assert engine.scheduler.lookup(b, 8) == 8  # an aligned prefix still hits
    engine.check()
