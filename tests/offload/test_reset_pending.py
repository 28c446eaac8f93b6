"""A reset that waits for transfers (SPEC §6.9, scenarios 21-22; Beyond: `tier_reset`).

It hides every key at once; while it waits, lazy walks and write-back demotions pause
(they would re-copy what it dropped), and requests admitted since are stored as usual.
"""

from __future__ import annotations

from sim import Admission, SimEngine, block_key, config, full_layout, make_request
from test_scenarios_cascade import cascade_engine, next_job
from test_scenarios_hybrid import hybrid_engine
from test_scenarios_lifecycle import loading_engine

from kvtier.core.events import BlockRemoved
from kvtier.offload.config import CascadeMode, StoreMode
from kvtier.offload.plan import Tier, TransferPlan


def copies(plan: TransferPlan) -> list[tuple[Tier, Tier]]:
    """Return the (src, dst) of the plan's stores and demotions."""
    return [(j.src_tier, j.dst_tier) for j in plan.jobs if j.dst_tier is not Tier.GPU]


def retry_every_step(engine: SimEngine, max_tries: int = 6) -> int:
    """Retry `reset` once per step, as an engine that keeps stepping does, completing
    every transfer each time; return the call that succeeded (1 = the first)."""
    for attempt in range(1, max_tries + 1):
        if engine.scheduler.reset():
            return attempt
        plan = engine.step()
        assert copies(plan) == [], "a walk or demotion re-copied what the reset dropped"
        engine.worker.complete_all()
        engine.poll()
        engine.check()
    raise AssertionError(f"reset still False after {max_tries} tries")


def test_a_reset_retried_every_step_in_lazy_mode_succeeds_once_the_old_stores_drain() -> None:
    # Regression: the reset cleared the lazy cursor, and the next walk re-selected the GPU
    # blocks whose stores it had abandoned (never registered, so "not in the tier"); the
    # retry abandoned those in turn, for ever.
    engine = SimEngine(full_layout(), config(store_mode=StoreMode.LAZY), num_gpu_blocks=8)
    engine.run(make_request("a", range(16)))
    engine.auto_complete = False
    engine.run(make_request("b", range(100, 116)))
    assert engine.worker.in_flight
    assert retry_every_step(engine) <= 2


def test_a_reset_retried_every_step_with_write_back_succeeds_once_demotions_drain() -> None:
    # Regression: write-back demoted another block each step; the retry abandoned it.
    engine = cascade_engine(CascadeMode.WRITE_BACK, num_cpu=9, num_disk=12)
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.auto_complete = False
    engine.run(make_request("b", range(200, 224)))  # "a" nears the CPU tier's victims
    engine.worker.complete_all()
    engine.poll()
    next_job(engine, Tier.CPU, Tier.DISK)  # a demotion in flight
    assert retry_every_step(engine) <= 2


def store_while_a_reset_waits(tokens: range) -> tuple[SimEngine, int]:
    """Return an engine whose reset waits for the store of tokens 300..307 (returned: its
    event id) and a request of `tokens`, admitted and finished meanwhile, whose 2 blocks
    were selected for storing."""
    engine = SimEngine(full_layout(), config(max_batched_tokens=8), num_tier_blocks=8)
    engine.auto_complete = False
    old = engine.store_of_finished(make_request("old", range(300, 308)))
    assert engine.scheduler.reset() is False
    engine.scheduler.take_stats()
    engine.evict_gpu()  # no GPU prefix hit: the request computes its blocks afresh
    engine.admit(make_request("d", tokens))
    engine.schedule("d")
    engine.step()
    engine.finish("d")
    engine.step()
    assert engine.scheduler.take_stats().store_outcomes == {"stored": 2}
    engine.check()
    return engine, old.event_id


def test_requests_admitted_while_a_reset_waits_are_stored_and_served() -> None:
    """Their KV is computed after the reset: stored and counted as usual (a first version
    stored nothing while the reset waited and lost what finished meanwhile)."""
    engine, old = store_while_a_reset_waits(range(100, 108))
    engine.worker.complete(old)
    engine.auto_complete = True
    engine.drain()
    engine.evict_gpu()
    assert engine.scheduler.lookup(make_request("old2", [*range(300, 308), 5]), 0) == 0
    assert engine.scheduler.lookup(make_request("d2", [*range(100, 108), 5]), 0) == 8
    engine.check()
    assert engine.scheduler.reset() is True  # the lookup pin is dropped; nothing in flight


def test_a_key_whose_store_a_reset_abandoned_is_stored_afresh_meanwhile() -> None:
    # Regression: the abandoned store kept its keys "in flight" until it reported, so a
    # request admitted after the reset with the same prompt (a shared system prompt after
    # a weight update) had its blocks skipped as in flight, and they were never stored.
    engine, old = store_while_a_reset_waits(range(300, 308))
    engine.worker.complete(old)  # the abandoned copy reports last
    engine.auto_complete = True
    engine.drain()
    engine.evict_gpu()
    again = make_request("again", [*range(300, 308), 5])
    assert engine.admit(again) == Admission(0, 8, 8)
    engine.step()
    engine.check_kv(again)  # served from the new copy
    engine.check()


def test_a_hand_off_while_a_reset_waits_is_stored() -> None:
    engine = hybrid_engine()
    engine.auto_complete = False
    engine.store_of_finished(make_request("old", range(300, 332), 16))
    assert engine.scheduler.reset() is False
    engine.scheduler.take_stats()
    c = make_request("c", range(48), 16, outputs=[90, 91])
    engine.admit(c)
    for _ in range(2):
        engine.schedule("c")
        engine.step()
    engine.handoff("c", 1, engine.tables["c"][1][2])
    engine.schedule("c")
    engine.step()
    assert engine.scheduler.take_stats().handoff_outcomes == {"stored": 1}
    engine.worker.complete_all()
    engine.poll()
    assert engine.scheduler.tier_pool.cached_block(block_key(engine.layout, c, 1, 2))
    engine.check()


def test_a_reset_that_waits_for_a_load_hides_the_tier_at_once() -> None:
    """A reset returning False (a load in flight) still hides all it is asked to drop.
    Before, the index stayed until a retry succeeded, so a caller that did not retry
    (vLLM's `reset_prefix_cache` returns a bool many ignore) was served KV from before
    the reset, e.g. from old weights."""
    engine, b = loading_engine(events=True)
    (load,) = engine.step().jobs
    engine.scheduler.take_events()
    assert engine.scheduler.reset() is False
    assert [type(e) for e in engine.scheduler.take_events()] == [BlockRemoved, BlockRemoved]
    c = make_request("c", [*range(8), 98])
    assert engine.scheduler.lookup(c, 0) == 0  # not from the block being loaded, either
    engine.worker.complete(load.event_id)
    assert engine.poll().finished_loads == ("b",)  # the load itself still completes
    engine.check_kv(b)
    assert engine.scheduler.lookup(c, 0) == 0
    engine.check()
    assert engine.scheduler.reset() is True


def test_an_abandoned_stores_report_leaves_a_later_store_of_its_keys_in_flight() -> None:
    """The abandoned store's keys were let go at the reset; "d", admitted since, stores
    them afresh. The abandoned store reporting must not take them off the in-flight keys
    again: "e", of the same prompt, would store them a second time."""
    engine, old = store_while_a_reset_waits(range(300, 308))
    engine.worker.complete(old)  # d's store of the same keys is still in flight
    engine.step()
    engine.evict_gpu()
    engine.scheduler.take_stats()
    engine.admit(make_request("e", range(300, 308)))
    engine.schedule("e")
    assert engine.step().jobs == ()
    engine.finish("e")
    assert engine.step().jobs == ()
    assert engine.scheduler.take_stats().store_outcomes == {"skipped_in_flight": 2}
    engine.auto_complete = True
    engine.drain()
    engine.check()


def assert_b_never_stored(engine: SimEngine) -> None:
    """Run b (allocated, tokens 0-16) to its end; assert the tier then offers nothing of
    its 16 tokens to a request sharing them."""
    engine.schedule("b")
    engine.step()
    engine.finish("b")
    engine.drain()
    engine.evict_gpu()
    assert engine.lookup(make_request("p", [*range(16), 4])).num_offered_tokens == 0
    engine.check()


def test_a_request_looked_up_before_a_reset_is_never_stored() -> None:
    """b is looked up before the reset (its GPU prefix and a tier hit pinned) and
    allocated after it: its prefix's KV, and all b computes from it, predates the reset
    (e.g. old weights), so none of its blocks may reach the emptied tier."""
    engine = SimEngine(full_layout(), config(), num_gpu_blocks=24, num_tier_blocks=16)
    engine.run(make_request("c", [*range(16), 1]))
    engine.drain()
    engine.evict_gpu()
    engine.run(make_request("a", [*range(8), 2]))  # blocks 0-1 loaded onto the GPU
    engine.drain()
    b = make_request("b", [*range(16), 3])
    found = engine.lookup(b)
    assert (found.num_local_tokens, found.num_offered_tokens) == (8, 8)
    assert engine.scheduler.reset() is True
    assert engine.allocate(b, found, 0) == Admission(8, 8, 0)  # the tier hit is gone
    assert_b_never_stored(engine)


def test_a_request_allocated_before_a_reset_and_looked_up_again_is_never_stored() -> None:
    """b ran before a first reset (no longer stored since), was preempted and looked up
    again (nothing in the emptied tier: no pin, its GPU prefix of 8 tokens found), then
    a second reset came before its allocation. Its KV still predates a reset: nothing of
    it reaches the tier (a mutant let the second reset miss it, tracked by no table and
    holding no pin: all 16 tokens were stored)."""
    engine = SimEngine(full_layout(), config(), num_gpu_blocks=24, num_tier_blocks=16)
    b = make_request("b", [*range(16), 3])
    engine.admit(b)
    engine.schedule("b", 8)
    engine.step()  # computes 0-8
    assert engine.scheduler.reset() is True
    engine.preempt("b")
    engine.step()
    found = engine.lookup(b)  # admitted afresh as far as the first reset goes
    assert (found.num_local_tokens, found.num_offered_tokens) == (8, 0)
    assert engine.scheduler.reset() is True
    assert engine.allocate(b, found, 0) == Admission(8, 0, 0)
    assert_b_never_stored(engine)


def test_a_request_looked_up_without_a_hit_before_a_reset_is_never_stored() -> None:
    """As `test_a_request_looked_up_before_a_reset_is_never_stored`, but b's lookup found
    no tier hit, so it pinned nothing: its GPU prefix of 8 tokens (a's, from before the
    reset) is still old KV, and nothing of b may reach the emptied tier. (Found by the
    s34 mutation run on tier_reset.py: the reset missed such a request, tracked by no
    table and holding no pin, and all 16 of its tokens were stored.)"""
    engine = SimEngine(full_layout(), config(), num_gpu_blocks=24, num_tier_blocks=16)
    engine.run(make_request("a", [*range(8), 2]))
    engine.drain()
    assert engine.scheduler.reset() is True
    b = make_request("b", [*range(16), 3])
    found = engine.lookup(b)
    assert (found.num_local_tokens, found.num_offered_tokens) == (8, 0)
    assert engine.scheduler.reset() is True
    assert engine.allocate(b, found, 0) == Admission(8, 0, 0)
    assert_b_never_stored(engine)
