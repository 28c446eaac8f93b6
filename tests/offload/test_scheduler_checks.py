"""`OffloadScheduler.check_invariants` catches what it is there for (`offload/
scheduler_checks.py`): every test calls it after each operation, so a check that went
quiet would let every other test pass over a leaked pin or a stray in-flight key.

Each test corrupts one piece of a consistent scheduler (a store in flight, or a
cascade's demotion in flight) and expects the check to name it.
"""

from __future__ import annotations

import pytest
from sim import SimEngine, config, full_layout, make_request
from test_cascade_demotions import key
from test_scenarios_cascade import cascade_engine, next_job

from kvtier.offload.config import CascadeMode, StoreMode
from kvtier.offload.plan import Tier


def store_in_flight(mode: StoreMode = StoreMode.EAGER) -> tuple[SimEngine, list[int]]:
    """An engine whose finished request's 2-block store is issued, not reported."""
    engine = SimEngine(full_layout(), config(store_mode=mode), num_gpu_blocks=8)
    store = engine.store_of_finished(make_request("a", range(9)))
    engine.check()
    return engine, list(store.src_block_ids)


def test_a_tier_pin_no_transfer_owns_is_caught() -> None:
    engine, _ = store_in_flight()
    engine.scheduler.tier_pool.touch([engine.scheduler.tier_pool.num_blocks - 1])
    with pytest.raises(AssertionError, match="ref 1, pins 0"):
        engine.check()


def test_an_in_flight_key_of_no_store_is_caught() -> None:
    engine, _ = store_in_flight()
    engine.scheduler.selector.in_flight_keys.add(key(99))
    with pytest.raises(AssertionError, match="in-flight keys"):
        engine.check()


def test_a_store_whose_gpu_block_lost_its_pin_is_caught() -> None:
    engine, gpu_ids = store_in_flight()
    engine.gpu.free([gpu_ids[0]])  # the engine dropped the copy's own reference
    with pytest.raises(AssertionError, match=f"GPU block {gpu_ids[0]}"):
        engine.scheduler.check_invariants()


def test_a_book_whose_store_count_disagrees_is_caught() -> None:
    engine, _ = store_in_flight()
    engine.scheduler._book.num_store_blocks += 1
    with pytest.raises(AssertionError, match="store blocks"):
        engine.check()


def test_a_held_back_block_the_walk_may_store_is_caught() -> None:
    engine, gpu_ids = store_in_flight(StoreMode.LAZY)
    engine.scheduler.selector.lazy.held[gpu_ids[0]] = key(98)
    with pytest.raises(AssertionError, match="held-back block"):
        engine.check()


def test_an_in_flight_demotion_key_of_no_move_is_caught() -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=9, num_disk=12)
    engine.auto_complete = False
    engine.admit(make_request("a", range(8)))
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    engine.worker.complete(next_job(engine, Tier.GPU, Tier.CPU).event_id)
    engine.poll()
    next_job(engine, Tier.CPU, Tier.DISK)  # in flight
    engine.check()
    assert engine.scheduler.cascade is not None
    engine.scheduler.cascade.in_flight_keys.add(key(97))
    with pytest.raises(AssertionError, match="in-flight demotions"):
        engine.check()
