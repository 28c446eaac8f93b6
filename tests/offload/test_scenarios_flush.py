"""SPEC §9 scenarios 9-14: finish-time flushes, of whole blocks and partial tails."""

from __future__ import annotations

import pytest
from flush_helpers import computed, in_tier, keys_of, num_cached_slots
from sim import SimEngine, block_key, config, full_layout, make_request

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.events import BlockStored
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout


def test_scenario_09_flushes_finishing_in_one_step_share_one_store_event() -> None:
    """Scenario 9: the finish flushes of two requests finishing together form one store event."""
    engine = SimEngine(full_layout())
    a = computed(engine, make_request("a", range(8)))
    b = computed(engine, make_request("b", range(100, 108)))
    tables = {*engine.tables["a"][0], *engine.tables["b"][0]}
    engine.finish("a")
    engine.finish("b")
    plan = engine.step()
    (store,) = plan.jobs
    assert store.is_store
    assert set(store.src_block_ids) == tables
    assert in_tier(engine, keys_of(engine, a, 2) + keys_of(engine, b, 2)) == [True] * 4
    engine.check()


def test_scenario_10_keys_already_in_the_tier_cost_no_transfer_and_no_capacity() -> None:
    """Scenario 10: a flush skips keys already in the tier: no copy, no extra slot."""
    engine = SimEngine(full_layout())
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()  # "b" computes its own blocks with a's keys
    assert num_cached_slots(engine) == 2
    engine.scheduler.take_stats()
    b = computed(engine, make_request("b", [*range(8), 50, 51, 52, 53]), accept=0)
    third = engine.tables["b"][0][2]
    engine.finish("b")
    (store,) = engine.step().jobs
    assert store.src_block_ids == (third,)
    stats = engine.scheduler.take_stats()
    assert stats.store_outcomes == {"skipped_already_cached": 2, "stored": 1}
    assert num_cached_slots(engine) == 3
    assert in_tier(engine, keys_of(engine, b, 3)) == [True] * 3
    engine.check()


def test_scenario_11_has_pending_stores_from_finish_until_the_store_completes() -> None:
    """Scenario 11: has_pending_stores() holds from finish (queued, in flight) to completion."""
    engine = SimEngine(full_layout())
    engine.auto_complete = False
    computed(engine, make_request("a", range(8)))
    assert not engine.scheduler.has_pending_stores()
    engine.finish("a")
    assert engine.scheduler.has_pending_stores()  # queued
    plan = engine.step()
    assert engine.scheduler.has_pending_stores()  # in flight
    engine.worker.complete(plan.jobs[0].event_id)
    engine.poll()
    assert not engine.scheduler.has_pending_stores()
    engine.check()


def three_kinds_layout(window: int = 8) -> KVLayout:
    return KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, window),
            KVGroupSpec(GroupKind.SCRATCH, 4, 64),
        )
    )


def test_scenario_12_every_cacheable_group_is_flushed() -> None:
    """Scenario 12: a finish flush covers every cacheable group and never the scratch group."""
    engine = SimEngine(three_kinds_layout(), num_gpu_blocks=16, num_tier_blocks=8)
    a = computed(engine, make_request("a", range(8)))
    full, sliding, scratch = engine.tables["a"]
    engine.finish("a")
    (store,) = engine.step().jobs
    assert sorted(store.src_block_ids) == sorted(full + sliding)
    assert not set(store.src_block_ids) & set(scratch)
    assert in_tier(engine, keys_of(engine, a, 2, 0) + keys_of(engine, a, 2, 1)) == [True] * 4
    engine.check()


@pytest.mark.parametrize("events", [False, True])
def test_scenario_12_flush_never_exceeds_free_tier_capacity(events: bool) -> None:
    """Scenario 12: a flush larger than the free tier stores only what fits, in table order."""
    engine = SimEngine(
        three_kinds_layout(), config(events=events), num_gpu_blocks=16, num_tier_blocks=4
    )
    computed(engine, make_request("a", range(8)))
    full, sliding, _ = engine.tables["a"]
    engine.scheduler.take_stats()
    engine.finish("a")
    (store,) = engine.step().jobs
    assert store.num_blocks == 3 == engine.scheduler.tier_pool.num_usable_blocks
    assert store.src_block_ids == (*full, sliding[0])
    outcomes = engine.scheduler.take_stats().store_outcomes
    assert outcomes == {"stored": 3, "dropped_tier_full": 1}
    engine.check()


def test_scenario_13_nulled_sliding_window_blocks_are_stored_from_the_gpu_cache() -> None:
    """Scenario 13: sliding-window blocks nulled in the table are recovered from the GPU cache."""
    engine = SimEngine(three_kinds_layout(window=4), num_gpu_blocks=24, num_tier_blocks=16)
    a = computed(engine, make_request("a", range(12)))
    sliding = list(engine.tables["a"][1])
    engine.drop_blocks("a", 1, [0, 1])  # window of 1 block: positions 0, 1 are out of it
    assert engine.tables["a"][1][:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    # Evict position 0 from the GPU cache (it was freed first, so it is the older).
    num_never_used = engine.gpu.num_free() - 2
    engine.gpu.free(engine.gpu.allocate(num_never_used + 1))
    assert engine.gpu.cached_block(block_key(engine.layout, a, 1, 0)) is None
    assert engine.gpu.cached_block(block_key(engine.layout, a, 1, 1)) == sliding[1]

    engine.scheduler.take_stats()
    engine.finish("a")
    (store,) = engine.step().jobs
    assert sliding[1] in store.src_block_ids
    assert sliding[0] not in store.src_block_ids
    assert NULL_BLOCK_ID not in store.src_block_ids
    assert in_tier(engine, keys_of(engine, a, 3, 1)) == [False, True, True]
    assert engine.scheduler.take_stats().store_outcomes == {"stored": 5, "dropped_null": 1}
    engine.check()


def fine_layout() -> KVLayout:
    return full_layout(block_size=8, hash_block_size=4)


def test_scenario_14_partial_tail_is_flushed_once_and_later_hit_whole() -> None:
    """Scenario 14: the fine-grained partial tail is stored once; a later prompt hits it all."""
    engine = SimEngine(fine_layout(), config(fine_grained_hits=True))
    a = make_request("a", range(12), outputs=[40, 41])
    engine.run(a)
    engine.drain()
    src = [b for job in engine.worker.stores() for b in job.src_block_ids]
    assert len(src) == len(set(src)) == 2  # block 0 while decoding, the tail at finish
    tail_key = make_key(a.block_hashes[2], 0)
    assert engine.tier_content(block_key(engine.layout, a, 0, 0)) == [
        block_key(engine.layout, a, 0, 0)
    ]
    assert engine.tier_content(tail_key) == [tail_key]
    tier = engine.scheduler.tier_pool
    assert tier.num_tokens(tier.cached_block(tail_key)) == 4
    engine.evict_gpu()

    b = make_request("b", [*range(12), 99])
    admission = engine.admit(b)
    assert admission is not None
    assert admission.num_accepted_tokens == 12
    (load,) = engine.step().jobs
    assert load.dst_block_ids == tuple(engine.tables["b"][0][:2])
    assert engine.loading == {}
    engine.check_kv(b)
    engine.check()


def test_a_partial_tail_s_event_describes_its_last_hash_block_as_vllm_does() -> None:
    """The fine-grained tail's `BlockStored` spans the tail key's last hash block (its
    tokens, the hash before it as parent), as vLLM's `cache_partial_block` event for the
    same hash does; it was payload-free (no tokens, no parent)."""
    engine = SimEngine(fine_layout(), config(fine_grained_hits=True, events=True))
    a = make_request("a", range(12), outputs=[40, 41])
    engine.run(a)
    engine.drain()
    events = engine.scheduler.take_events()
    (tail,) = [
        e for e in events if isinstance(e, BlockStored) and e.block_hash == a.block_hashes[2]
    ]
    assert (tail.block_size, tail.token_ids, tail.parent_block_hash) == (
        4,
        (8, 9, 10, 11),
        a.block_hashes[1],
    )
    assert (tail.group_kind, tail.medium) == ("full_attention", "CPU")


def test_scenario_14_a_partial_tail_shared_by_two_flushes_is_stored_once() -> None:
    """Scenario 14: two requests with one prompt finishing together store its tail once."""
    engine = SimEngine(fine_layout(), config(fine_grained_hits=True))
    a = make_request("a", range(12))
    for request in (a, make_request("a2", range(12))):
        assert engine.admit(request) is not None
        engine.schedule(request.request_id)
    engine.step()
    block_0, tail_block = engine.tables["a"][0]
    engine.scheduler.take_stats()
    engine.finish("a")
    engine.finish("a2")
    (store,) = engine.step().jobs
    assert store.src_block_ids == (block_0, tail_block)
    assert engine.scheduler.take_stats().store_outcomes == {"stored": 2, "skipped_in_flight": 2}
    tail_key = make_key(a.block_hashes[2], 0)
    assert engine.tier_content(tail_key) == [tail_key]
    engine.check()


@pytest.mark.parametrize("issued", [False, True])
def test_partial_tail_of_a_request_finished_during_its_load_is_not_stored(issued: bool) -> None:
    """A request finished before its load landed must not flush the load's destinations."""
    engine = SimEngine(fine_layout(), config(fine_grained_hits=True))
    engine.run(make_request("a", range(16), outputs=[5]))  # stores two whole blocks
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    y = make_request("y", range(16))
    admission = engine.admit(y)  # the hit ends inside block 1: 12 of 16 tokens
    assert admission is not None
    assert admission.num_accepted_tokens == 12
    destinations = set(engine.tables["y"][0])
    if issued:
        assert engine.step().jobs[0].is_load
    engine.finish("y")
    plan = engine.step()
    stored = {b for job in plan.jobs if job.is_store for b in job.src_block_ids}
    assert not stored & destinations


def test_partial_tail_of_a_request_finished_after_its_load_failed_unissued_is_not_stored() -> None:
    """A load that fails before issue (a hit block lost its keys) is reported with the next
    report; a request finished before it counts the load's tokens computed, and its
    partial tail (stored by the request's hash, not a GPU key) held another request's
    KV, which the tier then served under the tail's key."""
    engine = SimEngine(fine_layout(), config(fine_grained_hits=True))
    engine.run(make_request("a", range(16), outputs=[5]))
    engine.drain()
    engine.evict_gpu()
    y = make_request("y", range(16))
    found = engine.lookup(y)
    assert found.num_offered_tokens == 12
    pool = engine.scheduler.tier_pool
    pool.discard_keys(engine.scheduler.loads.pins["y"].hit.block_ids[0][0])
    assert engine.allocate(y, found) is not None  # the load fails unissued
    for block_id in engine.tables["y"][0]:
        engine.worker.write_gpu(block_id, "another request's KV")
    engine.finish("y")
    plan = engine.step()
    assert not [job for job in plan.jobs if job.is_store]
    assert pool.cached_block(make_key(y.block_hashes[2], 0)) is None
    engine.check()


def test_confirmed_tokens_exclude_output_placeholders() -> None:
    """Eager mode stores only blocks whose KV is confirmed: computed minus placeholders."""
    engine = SimEngine(full_layout())
    a = make_request("a", range(8), outputs=range(10))
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    for _ in range(4):  # decode four tokens: block 2 (tokens 8..11) is computed
        engine.schedule("a")
        engine.step()
    table = engine.tables["a"][0]
    a.num_output_placeholders = 1  # ... but one of its tokens is not confirmed yet
    engine.schedule("a")
    assert engine.step().jobs == ()
    a.num_output_placeholders = 0
    engine.schedule("a")
    (store,) = engine.step().jobs
    assert store.src_block_ids == (table[2],)
