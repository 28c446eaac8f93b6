"""SPEC §9 scenarios 17-22 (lifecycle, reset) and failed transfers (SPEC §6.8 Beyond)."""

from __future__ import annotations

import pytest
from sim import (
    Admission,
    SimEngine,
    SimRequest,
    block_key,
    config,
    full_layout,
    make_request,
)

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.events import AllCleared
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode
from kvtier.offload.transfers import FailedLoad


def loading_engine(**kwargs: object) -> tuple[SimEngine, SimRequest]:
    """Return an engine whose tier holds "a" (8 tokens) and a request "b" admitted to load it."""
    engine = SimEngine(full_layout(), config(**kwargs))
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    b = make_request("b", [*range(8), 99])
    assert engine.admit(b) == Admission(0, 8, 8)
    return engine, b


def assert_all_released(engine: SimEngine) -> None:
    """Assert no tier slot and no GPU block is referenced beyond the engine's own tables."""
    tier = engine.scheduler.tier_pool
    assert tier.num_free() == tier.num_usable_blocks
    refs = engine.engine_refs()
    for block_id in range(1, engine.gpu.num_blocks):
        assert engine.gpu.ref_count(block_id) == refs[block_id], f"GPU block {block_id}"
    engine.check()


def test_scenario_17_request_finishing_during_its_load_is_cleaned_up_on_completion() -> None:
    """Scenario 17: a request finished while its load is in flight leaks nothing afterwards."""
    engine, _ = loading_engine()
    (load,) = engine.step().jobs
    engine.finish("b")
    for block_id in load.dst_block_ids:
        assert engine.gpu.ref_count(block_id) == 1  # the load still pins its destinations
    engine.worker.complete(load.event_id)
    engine.poll()
    engine.step()
    assert_all_released(engine)


def test_scenario_17_request_finishing_during_its_store_is_cleaned_up_on_completion() -> None:
    """Scenario 17: a request finished while its own store is in flight leaks nothing."""
    engine = SimEngine(full_layout())
    engine.auto_complete = False
    a = make_request("a", range(8), outputs=[50, 51])
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.schedule("a")
    (store,) = engine.step().jobs  # stores the prompt's blocks while decoding
    engine.finish("a")
    engine.step()
    engine.worker.complete(store.event_id)
    engine.poll()
    engine.drain()
    assert_all_released(engine)
    assert engine.tier_content(block_key(engine.layout, a, 0, 1)) == [
        block_key(engine.layout, a, 0, 1)
    ]


def test_scenario_18_no_null_ids_in_plans_and_scratch_groups_never_move() -> None:
    """Scenario 18: plans never carry the null block; scratch blocks are never stored or loaded."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4),
            KVGroupSpec(GroupKind.SCRATCH, 4, 64),
        )
    )
    engine = SimEngine(layout, num_gpu_blocks=32, num_tier_blocks=16)
    scratch: set[int] = set()
    a = make_request("a", range(12))
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.drop_blocks("a", 1, [0, 1])  # the table now holds null ids
    scratch.update(engine.tables["a"][2])
    engine.finish("a")
    engine.drain()
    engine.evict_gpu()
    b = make_request("b", [*range(12), 99])
    admission = engine.admit(b)
    assert admission is not None
    assert admission.num_accepted_tokens == 12
    scratch.update(engine.tables["b"][2])
    (load,) = engine.step().jobs
    assert load.num_blocks == 3 + 1  # full attention: 3 blocks; sliding window: its last
    jobs = list(engine.worker.jobs.values())
    assert {job.is_store for job in jobs} == {True, False}
    for job in jobs:
        assert NULL_BLOCK_ID not in job.src_block_ids + job.dst_block_ids
        gpu_ids = job.src_block_ids if job.is_store else job.dst_block_ids
        assert scratch.isdisjoint(gpu_ids)
    engine.check_kv(b)
    engine.check()


def test_scenario_19_second_prefill_chunk_stores_exactly_its_new_blocks() -> None:
    """Scenario 19: with chunked prefill each chunk's blocks are stored once, on the next step."""
    engine = SimEngine(full_layout())
    a = make_request("a", range(16), outputs=[70, 71])
    engine.admit(a)
    engine.schedule("a", 8)
    assert engine.step().jobs == ()
    engine.schedule("a", 8)
    (first,) = engine.step().jobs
    table = engine.tables["a"][0]
    assert first.src_block_ids == (table[0], table[1])
    engine.scheduler.take_stats()
    engine.schedule("a")
    (second,) = engine.step().jobs
    assert second.src_block_ids == (table[2], table[3])
    # Only the new blocks were visited: the cursor is past the first chunk's.
    assert engine.scheduler.take_stats().store_outcomes == {"stored": 2}
    engine.check()


def test_scenario_20_after_preemption_only_the_new_confirmed_tail_is_stored() -> None:
    """Scenario 20: a resumed request re-stores nothing; only its new confirmed blocks go down."""
    engine = SimEngine(full_layout())
    a = make_request("a", range(16), outputs=[70, 71, 72, 73, 74])
    engine.admit(a)
    engine.schedule("a", 8)
    engine.step()
    engine.schedule("a", 8)
    engine.step()  # stores blocks 0, 1
    old_table = engine.tables["a"][0]
    engine.preempt("a")
    plan = engine.step()
    assert plan.need_flush
    # blocks 2, 3: computed in the step before the preemption, confirmed only now
    assert [b for job in plan.jobs for b in job.src_block_ids] == old_table[2:4]
    admission = engine.admit(a)
    assert admission == Admission(16, 0, 0)  # its blocks are still cached on the GPU
    stored_before = len(engine.worker.stores())
    for _ in range(5):  # decode 70..74: on the 5th step tokens 16..19 are confirmed
        engine.schedule("a")
        engine.step()
    table = engine.tables["a"][0]
    new_stores = engine.worker.stores()[stored_before:]
    src = [b for job in new_stores for b in job.src_block_ids]
    assert src == [table[4]]
    engine.check()


def test_scenario_20_resume_rescans_the_table_and_restores_what_the_tier_lost() -> None:
    """Scenario 20 (SPEC §6.5: a preempted request resets its cursors): blocks stored before
    the preemption and evicted from the tier meanwhile are stored again after the resume."""
    engine = SimEngine(full_layout(), num_gpu_blocks=16, num_tier_blocks=5)
    a = make_request("a", range(16), outputs=[70, 71, 72])
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.schedule("a")
    (store,) = engine.step().jobs  # blocks 0..3: the cursor is past them
    assert store.num_blocks == 4
    engine.preempt("a")
    engine.step()
    engine.run(make_request("c", range(100, 108)))  # evicts a's tail blocks 3, 2
    engine.drain()
    a_keys = [block_key(engine.layout, a, 0, pos) for pos in range(4)]
    tier = engine.scheduler.tier_pool
    assert [tier.cached_block(k) is not None for k in a_keys] == [True, True, False, False]
    assert engine.admit(a) == Admission(16, 0, 0)
    engine.scheduler.take_stats()
    engine.schedule("a")
    (store,) = engine.step().jobs
    table = engine.tables["a"][0]
    assert store.src_block_ids == (table[2], table[3])
    assert engine.scheduler.take_stats().store_outcomes == {
        "skipped_already_cached": 2,
        "stored": 2,
    }
    engine.check()


@pytest.mark.parametrize("mode", [StoreMode.EAGER, StoreMode.LAZY])
def test_scenario_21_reset_with_in_flight_stores_waits_and_hides_their_data(
    mode: StoreMode,
) -> None:
    """Scenario 21: reset returns False while stores are in flight; they never become visible.

    Per-request state and the lazy cursor are cleared by the first reset (SPEC §6.9)."""
    engine = SimEngine(
        full_layout(), config(store_mode=mode, max_batched_tokens=8), num_gpu_blocks=5
    )
    engine.auto_complete = False
    a = make_request("a", range(8))
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    (store,) = engine.step().jobs
    assert store.num_blocks == 2
    assert engine.scheduler.reset() is False
    assert engine.scheduler.selector.tracked == {}  # SPEC §6.9: cleared at once
    assert engine.scheduler.selector.lazy.cursor is None
    assert engine.scheduler.reset() is False
    engine.worker.complete(store.event_id)
    engine.poll()
    keys = [block_key(engine.layout, a, 0, pos) for pos in (0, 1)]
    assert [engine.scheduler.tier_pool.cached_block(k) for k in keys] == [None, None]
    assert engine.scheduler.reset() is True
    assert_all_released(engine)


def test_scenario_22_reset_releases_lookup_pins() -> None:
    """Scenario 22: reset drops a lookup's pin and then clears the tier."""
    engine = SimEngine(full_layout(), config(events=True))
    engine.run(make_request("a", range(8)))
    engine.drain()
    b = make_request("b", [*range(8), 99])
    assert engine.scheduler.lookup(b, 0) == 8
    engine.scheduler.take_events()
    assert engine.scheduler.reset() is True
    assert engine.scheduler.take_events() == [AllCleared("CPU")]
    assert engine.scheduler.lookup(b, 0) == 0
    assert_all_released(engine)


def test_scenario_22_reset_with_an_issued_load_waits_for_it() -> None:
    """Scenario 22: reset returns False while a load is in flight, True once it completed."""
    engine, b = loading_engine()
    (load,) = engine.step().jobs
    assert engine.scheduler.reset() is False
    engine.worker.complete(load.event_id)
    outcome = engine.poll()
    assert outcome.finished_loads == ("b",)
    engine.check_kv(b)
    assert engine.scheduler.reset() is True
    assert_all_released(engine)


def test_scenario_22_never_issued_finish_flushes_are_dropped_by_reset() -> None:
    """Scenario 22: reset drops queued finish flushes at once and returns True."""
    engine = SimEngine(full_layout())
    a = make_request("a", range(8))
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    assert engine.scheduler.has_pending_stores()
    assert engine.scheduler.reset() is True
    assert not engine.scheduler.has_pending_stores()
    assert engine.step().jobs == ()
    assert_all_released(engine)


def test_reset_stores_nothing_a_request_running_across_it_computes() -> None:
    """Eager mode: KV computed before a reset (e.g. before a weight update), and all built
    on it, stays out of the emptied tier; a request arriving after the reset is stored."""
    engine = SimEngine(full_layout())
    a = make_request("a", range(16))
    engine.admit(a)
    engine.schedule("a", 8)
    engine.step()  # the first 8 tokens
    assert engine.scheduler.reset() is True
    engine.schedule("a")
    engine.step()  # the last 8, computed on the pre-reset KV
    engine.finish("a")
    engine.drain()
    engine.evict_gpu()
    tier = engine.scheduler.tier_pool
    assert [tier.cached_block(block_key(engine.layout, a, 0, p)) for p in range(4)] == [None] * 4
    b = make_request("b", range(100, 108))
    engine.run(b)
    engine.drain()
    engine.evict_gpu()
    assert all(tier.cached_block(block_key(engine.layout, b, 0, p)) for p in range(2))
    engine.check()


def test_reset_fails_queued_loads_in_the_next_report() -> None:
    """A load queued but not yet issued is dropped by reset and reported as failed."""
    engine, b = loading_engine()
    assert engine.scheduler.reset() is True
    outcome = engine.poll()
    assert outcome.failed_loads == (FailedLoad("b", 0, 8),)
    assert b.num_computed_tokens == 0
    assert engine.step().jobs == ()
    assert_all_released(engine)


def test_failed_store_registers_nothing_and_frees_its_slots() -> None:
    """A failed store makes no key visible and returns its slots and GPU pins."""
    engine = SimEngine(full_layout())
    engine.auto_complete = False
    a = make_request("a", range(8))
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    (store,) = engine.step().jobs
    engine.scheduler.take_stats()
    engine.worker.fail(store.event_id)
    engine.poll()
    keys = [block_key(engine.layout, a, 0, pos) for pos in (0, 1)]
    assert [engine.scheduler.tier_pool.cached_block(k) for k in keys] == [None, None]
    assert engine.scheduler.take_stats().num_failed_stores == 2
    assert not engine.scheduler.has_pending_stores()
    assert_all_released(engine)


def test_failed_load_reports_its_token_range_and_releases_pins() -> None:
    """A failed load returns [start, end) of the external tokens; its pins are released."""
    engine = SimEngine(full_layout(), num_gpu_blocks=16)
    a = make_request("a", range(16))
    engine.run(a)
    engine.drain()
    kept = engine.gpu.cached_block(block_key(engine.layout, a, 0, 0))
    engine.gpu.touch([kept])  # keep a's first block on the GPU: a local hit of 4 tokens
    engine.evict_gpu()
    engine.gpu.free([kept])
    engine.auto_complete = False
    b = make_request("b", [*range(16), 99])
    assert engine.admit(b) == Admission(4, 12, 12)
    (load,) = engine.step().jobs
    engine.worker.fail(load.event_id)
    outcome = engine.poll()
    # Nothing named: every block the load wrote is suspect.
    assert outcome == type(outcome)((), (FailedLoad("b", 4, 16),), {"b": load.dst_block_ids})
    assert b.num_computed_tokens == 4  # the engine recomputes the external tokens
    assert_all_released(engine)
    engine.auto_complete = True
    engine.schedule("b")
    engine.step()  # recomputes over the garbage the failed copy left
    engine.finish("b")
    engine.drain()
    assert_all_released(engine)


def test_on_allocated_without_a_lookup_pin_fails_the_load_in_the_next_report() -> None:
    """External tokens accepted without a pinned lookup hit come back as a failed load."""
    engine = SimEngine(full_layout())
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    b = make_request("b", [*range(8), 99])
    found = engine.lookup(b)
    assert found.num_offered_tokens == 8
    assert engine.scheduler.reset() is True  # drops the pin (and the tier)
    assert not engine.scheduler.has_unissued_failures()
    assert engine.allocate(b, found) == Admission(0, 8, 8)
    assert engine.scheduler.has_unissued_failures()  # engines may skip empty drains until then
    plan = engine.step()
    assert plan.jobs == ()
    assert engine.outcomes[-1].failed_loads == (FailedLoad("b", 0, 8),)
    assert not engine.scheduler.has_unissued_failures()
    assert "b" not in engine.loading
    assert_all_released(engine)


def test_accepting_more_than_the_pinned_hit_fails_the_load() -> None:
    """Accepting more external tokens than lookup offered loads nothing and fails the load."""
    engine = SimEngine(full_layout())
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    b = make_request("b", [*range(12), 99])
    found = engine.lookup(b)
    assert found.num_offered_tokens == 8
    assert engine.allocate(b, found, accept=12) == Admission(0, 8, 12)
    assert engine.step().jobs == ()
    assert engine.outcomes[-1].failed_loads == (FailedLoad("b", 0, 12),)
    assert_all_released(engine)
