"""SPEC §9 scenarios 23-26 (hybrid models, hand-offs, event metadata, workers)."""

from __future__ import annotations

from sim import Admission, SimEngine, block_key, config, full_layout, make_request

from kvtier.core.events import BlockStored
from kvtier.core.keys import key_block_hash, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.transfers import FailedLoad

FULL = GroupKind.FULL_ATTENTION
STATE = GroupKind.STATE
SLIDING = GroupKind.SLIDING_WINDOW


def full_and_state_layout() -> KVLayout:
    """Full attention in blocks of 32, recurrent state every 16 tokens (hash block 16)."""
    return KVLayout((KVGroupSpec(FULL, 32, 64), KVGroupSpec(STATE, 16, 64)))


def hybrid_engine(**kwargs: object) -> SimEngine:
    return SimEngine(
        full_and_state_layout(),
        config(fine_grained_hits=True, **kwargs),
        num_gpu_blocks=32,
        num_tier_blocks=16,
    )


def store_with_state_handoff(engine: SimEngine) -> None:
    """Run request "a" (48 tokens, 2 outputs), hand off its state after 48 tokens, finish
    it, and evict the GPU: the tier holds the full blocks and that one state block."""
    a = make_request("a", range(48), 16, outputs=[90, 91])
    engine.admit(a)
    for _ in range(2):
        engine.schedule("a")
        engine.step()
    engine.handoff("a", 1, engine.tables["a"][1][2])  # the state after 48 tokens
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    engine.drain()
    engine.evict_gpu()


def test_scenario_23_state_blocks_come_from_handoffs_and_fine_hits_load_the_right_blocks() -> None:
    """Scenario 23: state blocks are stored only from hand-offs; a fine hit loads full + state."""
    engine = hybrid_engine()
    a = make_request("a", range(48), 16, outputs=[90, 91])
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.schedule("a")
    (store,) = engine.step().jobs  # the state blocks are keyed on the GPU, but not handed off
    full, state = engine.tables["a"]
    assert set(store.src_block_ids) == {full[0]}
    engine.handoff("a", 1, state[2])  # the state after 48 tokens
    engine.schedule("a")
    (store,) = engine.step().jobs
    assert set(store.src_block_ids) == {state[2]}
    engine.finish("a")
    engine.drain()
    tier = engine.scheduler.tier_pool
    state_keys = [block_key(engine.layout, a, 1, pos) for pos in range(3)]
    assert [tier.cached_block(k) is not None for k in state_keys] == [False, False, True]
    stored_state = {b for job in engine.worker.stores() for b in job.src_block_ids} & set(state)
    assert stored_state == {state[2]}
    engine.evict_gpu()

    b = make_request("b", [*range(48), 7], 16)
    assert engine.admit(b) == Admission(0, 48, 48)  # one full block + a partial tail
    (load,) = engine.step().jobs
    b_full, b_state = engine.tables["b"]
    assert sorted(load.dst_block_ids) == sorted([b_full[0], b_full[1], b_state[2]])
    pairs = dict(zip(load.dst_block_ids, load.src_block_ids, strict=True))
    assert pairs[b_state[2]] == tier.cached_block(state_keys[2])
    assert pairs[b_full[1]] == tier.cached_block(make_key(a.block_hashes[2], 0))  # the tail
    assert engine.loading == {}
    engine.check_kv(b)  # right content on every block b reads (poll() checked it too)
    engine.schedule("b")
    engine.step()
    engine.check()


def test_scenario_24_handoffs_of_gone_requests_are_dropped_and_counted() -> None:
    """Scenario 24: hand-offs of finished, preempted or unknown requests are dropped, counted."""
    engine = hybrid_engine()
    requests = {}
    for i, name in enumerate(("done", "preempted", "running")):
        requests[name] = make_request(name, range(100 * i, 100 * i + 32), 16, outputs=[1, 2])
        engine.admit(requests[name])
        engine.schedule(name)
    engine.step()
    state = {name: engine.tables[name][1][1] for name in requests}
    engine.finish("done")
    engine.preempt("preempted")
    engine.schedule("running")
    for name in requests:
        engine.handoff(name, 1, state[name])
    engine.handoff("unknown", 1, state["running"])
    engine.scheduler.take_stats()
    plan = engine.step()
    stored = {b for job in plan.jobs if job.is_store for b in job.src_block_ids}
    assert state["running"] in stored
    assert not stored & {state["done"], state["preempted"]}
    stats = engine.scheduler.take_stats()
    assert stats.handoff_outcomes == {"dropped_request_gone": 3, "stored": 1}
    engine.check()


def test_scenario_25_event_metadata_stays_index_parallel_with_the_block_lists() -> None:
    """Scenario 25: with events on, event i describes the block copied to dst slot i."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), KVGroupSpec(SLIDING, 4, 64, 8)))
    engine = SimEngine(layout, config(events=True), num_gpu_blocks=32, num_tier_blocks=16)
    engine.run(make_request("a", [*range(4), 60, 61, 62, 63]))
    engine.drain()
    engine.evict_gpu()
    engine.scheduler.take_events()
    # b shares block 0 with a (skipped: already cached), then differs.
    b = make_request("b", [*range(4), *range(10, 22)], 4)
    engine.admit(b, accept=0)
    engine.schedule("b")
    engine.step()
    tables = engine.tables["b"]
    engine.finish("b")
    (store,) = engine.step().jobs
    assert sorted(store.src_block_ids) == sorted(tables[0][1:] + tables[1][1:])
    events = engine.scheduler.take_events()
    assert len(events) == store.num_blocks
    tier = engine.scheduler.tier_pool
    for event, src, dst in zip(events, store.src_block_ids, store.dst_block_ids, strict=True):
        assert isinstance(event, BlockStored)
        group_id = event.group_id
        pos = tables[group_id].index(src)
        assert event.block_hash == b.block_hashes[pos]
        assert event.parent_block_hash == b.block_hashes[pos - 1]
        assert event.token_ids == tuple(b.token_ids[4 * pos : 4 * pos + 4])
        assert tier.cached_block(make_key(event.block_hash, group_id)) == dst
        assert engine.worker.tier[0][dst] == block_key(layout, b, group_id, pos)
    engine.check()


def test_scenario_26_store_completes_only_after_both_workers_report() -> None:
    """Scenario 26: with 2 workers a store becomes visible only after both finished it."""
    engine = SimEngine(full_layout(), num_workers=2)
    engine.auto_complete = False
    a = make_request("a", range(8))
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    (store,) = engine.step().jobs
    key = block_key(engine.layout, a, 0, 0)
    engine.worker.complete(store.event_id, workers=[1])
    engine.poll()
    assert engine.scheduler.tier_pool.cached_block(key) is None
    assert engine.scheduler.has_pending_stores()
    engine.worker.complete(store.event_id, workers=[0])
    engine.poll()
    assert engine.tier_content(key) == [key, key]
    assert not engine.scheduler.has_pending_stores()
    engine.check()


def test_scenario_26_load_finishes_after_both_workers_and_fails_if_either_fails() -> None:
    """Scenario 26: a 2-worker load finishes when both report; one failure fails it."""
    engine = SimEngine(full_layout(), num_workers=2)
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    b = make_request("b", [*range(8), 99])
    c = make_request("c", [*range(8), 98])
    engine.admit(b)
    (load_b,) = engine.step().jobs
    engine.admit(c)
    (load_c,) = engine.step().jobs
    engine.worker.complete(load_b.event_id, workers=[0])
    engine.worker.fail(load_c.event_id, workers=[1])
    assert engine.poll().finished_loads == ()
    engine.worker.complete(load_b.event_id, workers=[1])
    engine.worker.complete(load_c.event_id, workers=[0])
    outcome = engine.poll()
    assert outcome.finished_loads == ("b",)
    assert outcome.failed_loads == (FailedLoad("c", 0, 8),)
    assert key_block_hash(block_key(engine.layout, b, 0, 0)) == b.block_hashes[0]
    engine.check()
