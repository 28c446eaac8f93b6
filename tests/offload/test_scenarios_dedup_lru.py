"""SPEC §9 scenarios 15-16: deduplication of stores, and LRU in the tier and the GPU cache."""

from __future__ import annotations

import pytest
from flush_helpers import in_tier, keys_of
from sim import SimEngine, SimRequest, config, full_layout, make_request

from kvtier.offload.config import StoreMode


def test_scenario_15_same_hashes_store_nothing_again_across_steps() -> None:
    """Scenario 15: a second request with the same hashes stores nothing, in flight or done."""
    engine = SimEngine(full_layout())
    engine.auto_complete = False
    a = make_request("a", range(8))
    b = make_request("b", range(8))
    assert engine.admit(a) is not None
    assert engine.admit(b) is not None  # admitted together: distinct GPU blocks, same keys
    engine.schedule("a")
    engine.schedule("b")
    engine.step()
    assert set(engine.tables["a"][0]).isdisjoint(engine.tables["b"][0])
    engine.finish("a")
    (store,) = engine.step().jobs
    assert store.num_blocks == 2
    engine.scheduler.take_stats()
    engine.finish("b")
    assert engine.step().jobs == ()  # a's copies are still in flight
    assert engine.scheduler.take_stats().store_outcomes == {"skipped_in_flight": 2}
    engine.worker.complete(store.event_id)
    engine.poll()

    engine.evict_gpu()
    engine.auto_complete = True
    engine.run(make_request("c", range(8)), accept=0)
    assert engine.step().jobs == ()
    assert engine.scheduler.take_stats().store_outcomes == {"skipped_already_cached": 2}
    engine.check()


def test_scenario_15_lazy_mode_skips_keys_already_stored() -> None:
    """Scenario 15: lazy mode does not store a free GPU block whose key is in the tier."""
    cfg = config(store_mode=StoreMode.LAZY, max_batched_tokens=8)
    engine = SimEngine(full_layout(), cfg, num_gpu_blocks=5)
    engine.run(make_request("a", range(8)))
    (store,) = engine.step().jobs
    assert store.num_blocks == 2
    engine.scheduler.take_stats()
    assert engine.step().jobs == ()
    assert engine.scheduler.take_stats().store_outcomes.get("skipped_already_cached", 0) >= 1
    engine.check()


def test_lazy_mode_does_not_copy_round_in_circles_through_a_small_tier() -> None:
    """Lazy stores into a tier smaller than the GPU cache stop once every block is copied.

    A stored block's unpin puts it at the GPU free queue's MRU end; once the tier evicted
    its copy, storing it again would evict another, forever, with no request left. A
    request using the block again makes it a candidate again.
    """
    cfg = config(store_mode=StoreMode.LAZY, max_batched_tokens=4)  # walks 2 blocks a step
    engine = SimEngine(full_layout(), cfg, num_gpu_blocks=13, num_tier_blocks=4)
    for name in ("a", "again"):  # "again" hits every block on the GPU: used again
        engine.run(make_request(name, range(48)))  # 12 cached GPU blocks, a 3-slot tier
        engine.scheduler.take_stats()
        for _ in range(20):  # idle steps
            engine.step()
        assert not engine.scheduler.has_pending_stores()
        outcomes = engine.scheduler.take_stats().store_outcomes
        # Each block at most once ("again": all but those the 3-slot tier still holds).
        assert (12 if name == "a" else 9) <= outcomes["stored"] <= 12
        assert outcomes["skipped_stored_before"] > 0
        engine.check()


def one_block_requests(engine: SimEngine, *names: str) -> dict[str, SimRequest]:
    """Run one 4-token request per name, each stored and drained before the next."""
    requests = {}
    for name in names:
        first = 100 * ord(name[0])
        requests[name] = make_request(name, range(first, first + 4))
        engine.run(requests[name])
        engine.drain()
    return requests


@pytest.mark.parametrize("touch_a", [False, True])
def test_scenario_16_full_tier_evicts_the_least_recently_used(touch_a: bool) -> None:
    """Scenario 16: storing C into a full tier evicts LRU of A, B; touching A makes B the victim."""
    engine = SimEngine(full_layout(), num_tier_blocks=3)
    requests = one_block_requests(engine, "a", "b")
    a, b = requests["a"], requests["b"]
    if touch_a:
        engine.evict_gpu()
        reader = make_request("reader", [*a.token_ids, 7])
        engine.run(reader)  # loads A from the tier
        engine.drain()
        assert engine.worker.loads()
    one_block_requests(engine, "c")
    a_in, b_in = in_tier(engine, keys_of(engine, a, 1) + keys_of(engine, b, 1))
    assert (a_in, b_in) == ((True, False) if touch_a else (False, True))
    engine.check()


def test_scenario_16_a_stored_prefix_loses_its_tail_before_its_root() -> None:
    """Scenario 16: under tier pressure a stored prefix is evicted tail-first (SPEC §4)."""
    engine = SimEngine(full_layout(), num_tier_blocks=4)
    a = make_request("a", range(12))
    engine.run(a)
    engine.drain()
    one_block_requests(engine, "x")  # needs one slot: evicts one of a's
    assert in_tier(engine, keys_of(engine, a, 3)) == [True, True, False]


def test_scenario_16_a_loaded_prefix_loses_its_tail_before_its_root() -> None:
    """Scenario 16: after a tier hit, the hit prefix is evicted tail-first (SPEC §4)."""
    engine = SimEngine(full_layout(), num_tier_blocks=4)
    a = make_request("a", range(12))
    engine.run(a)
    engine.drain()
    engine.evict_gpu()
    engine.run(make_request("reader", [*range(12), 7]))  # loads all three blocks
    engine.drain()
    assert engine.worker.loads()[-1].num_blocks == 3
    one_block_requests(engine, "x")  # needs one slot: evicts one of a's
    assert in_tier(engine, keys_of(engine, a, 3)) == [True, True, False]


def test_finished_request_blocks_keep_tail_first_gpu_eviction_after_their_store() -> None:
    """The engine frees blocks tail-first; a flush's pins must not turn that into root-first."""
    engine = SimEngine(full_layout(), num_gpu_blocks=8)
    a = make_request("a", range(12))
    engine.run(a)
    engine.drain()
    num_never_used = engine.gpu.num_free() - 3
    engine.gpu.free(engine.gpu.allocate(num_never_used + 1))  # evict one of a's blocks
    cached = [engine.gpu.cached_block(k) is not None for k in keys_of(engine, a, 3)]
    assert cached == [True, True, False]


def test_lazy_mode_counts_a_block_waiting_for_a_tier_slot_once() -> None:
    """A lazy walk that stops at a full tier retries the same block each step: it counts
    once as deferred, and the next block it stops at counts once more."""
    cfg = config(store_mode=StoreMode.LAZY, max_batched_tokens=16)
    engine = SimEngine(full_layout(), cfg, num_gpu_blocks=9, num_tier_blocks=3)
    engine.auto_complete = False
    engine.run(make_request("a", range(16)))  # 4 cached GPU blocks, a 2-slot tier
    engine.scheduler.take_stats()
    (store,) = engine.step().jobs
    assert store.num_blocks == 2
    assert engine.scheduler.take_stats().store_outcomes == {"stored": 2, "deferred_tier_full": 1}
    for _ in range(3):  # the 2 slots are still being written
        assert engine.step().jobs == ()
    assert engine.scheduler.take_stats().store_outcomes == {}
    engine.worker.complete(store.event_id)
    engine.poll()
    (store,) = engine.step().jobs  # the tier evicts the first 2 copies for the next 2
    assert store.num_blocks == 2
    outcomes = engine.scheduler.take_stats().store_outcomes
    assert outcomes.get("deferred_tier_full", 0) == 0
    engine.worker.complete(store.event_id)
    engine.poll()
    engine.check()
