"""A reset that waits for transfers (SPEC §6.9, scenarios 21-22; Beyond: `tier_reset`).

It hides every key at once, plans no store or demotion while it waits, and completes by
itself with the report that leaves nothing outstanding.
"""

from __future__ import annotations

from sim import Admission, SimEngine, block_key, config, full_layout, make_request
from test_scenarios_cascade import cascade_engine, next_job

from kvtier.core.events import AllCleared, BlockRemoved
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
        assert copies(plan) == [], "a store or demotion planned while a reset waits"
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


def test_a_waiting_reset_completes_by_itself_and_stores_resume() -> None:
    """A caller that never retries: the report that drains the old transfers completes
    the reset (AllCleared), and the next requests are stored again."""
    engine = SimEngine(full_layout(), config(events=True, max_batched_tokens=8))
    engine.auto_complete = False
    a = make_request("a", range(8))
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    (store,) = engine.step().jobs
    engine.scheduler.take_events()
    assert engine.scheduler.reset() is False
    c = make_request("c", range(50, 58))  # admitted and computed while the reset waits
    engine.admit(c)
    engine.schedule("c")
    assert copies(engine.step()) == []
    engine.worker.complete(store.event_id)
    engine.poll()
    assert engine.scheduler.take_events() == [AllCleared("CPU")]
    engine.check()
    engine.auto_complete = True
    engine.finish("c")  # its blocks, held back while the reset waited, are stored now
    engine.drain()
    keys = [block_key(engine.layout, c, 0, pos) for pos in (0, 1)]
    assert all(engine.scheduler.tier_pool.cached_block(k) is not None for k in keys)
    a_keys = [block_key(engine.layout, a, 0, pos) for pos in (0, 1)]
    assert [engine.scheduler.tier_pool.cached_block(k) for k in a_keys] == [None, None]
    assert engine.scheduler.reset() is True


def test_a_reset_that_waits_for_a_load_hides_the_tier_at_once() -> None:
    """A reset returning False (a load in flight) still hides all it is asked to drop.
    Before, the index stayed until a retry succeeded, so a caller that did not retry
    (vLLM's `reset_prefix_cache` returns a bool many ignore) was served KV from before
    the reset, e.g. from old weights."""
    engine = SimEngine(full_layout(), config(events=True))
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    b = make_request("b", [*range(8), 99])
    assert engine.admit(b) == Admission(0, 8, 8)
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
