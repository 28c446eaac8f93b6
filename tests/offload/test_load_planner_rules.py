"""Lookup pins and queued loads across retries, aborts and resets (SPEC §6.2, §6.3, §6.7-§6.9)."""

from __future__ import annotations

import pytest
from sim import SimEngine, full_layout, make_request
from sim_request import SimRequest
from test_scenarios_cascade import cascade_engine, holds, keys_of

from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier
from kvtier.offload.transfers import FailedLoad


def stored_engine() -> SimEngine:
    """Return an engine whose tier holds the 3 blocks of a 12-token request (GPU evicted)."""
    engine = SimEngine(full_layout())
    engine.run(make_request("a", range(12)))
    engine.drain()
    engine.evict_gpu()
    return engine


def tier_refs(engine: SimEngine) -> list[int]:
    pool = engine.scheduler.tier_pool
    return [pool.ref_count(block) for block in range(1, pool.num_blocks)]


def test_a_repeated_lookup_replaces_the_earlier_pin() -> None:
    """SPEC §6.2 step 1: a lookup first drops the pin of an earlier lookup of the same
    request (a retry after a failed allocation); otherwise that pin leaks and the hit's
    tier blocks can never be evicted again."""
    engine = stored_engine()
    b = make_request("b", [*range(12), 7])
    assert engine.scheduler.lookup(b, 0) == 12
    assert engine.scheduler.lookup(b, 0) == 12  # the engine could not allocate: retry
    assert engine.scheduler.on_allocated(b, [[]], 0) == {}  # then declined after all
    assert tier_refs(engine) == [0] * len(tier_refs(engine))
    engine.check()


def test_a_request_finished_while_waiting_lets_go_of_its_lookup_pin() -> None:
    """SPEC §6.7: a request aborted between its lookup and its allocation releases the
    pin the lookup took; otherwise the hit's tier blocks could never be evicted again."""
    engine = stored_engine()
    b = make_request("b", [*range(12), 7])
    assert engine.scheduler.lookup(b, 0) == 12
    assert tier_refs(engine).count(1) == 3  # the hit's three blocks are pinned
    engine.scheduler.on_finished(b, [[]], computed=False)
    assert tier_refs(engine) == [0] * len(tier_refs(engine))
    engine.check()


def test_a_block_table_one_block_short_raises_and_leaves_no_pin() -> None:
    """SPEC §6.3: a table without room for every accepted block is the engine's error
    (ValueError naming the group), and the lookup pin does not leak."""
    engine = stored_engine()
    b = make_request("b", [*range(12), 7])
    assert engine.scheduler.lookup(b, 0) == 12
    table = engine.gpu.allocate(2)  # 12 tokens need 3 blocks
    with pytest.raises(ValueError, match="group 0"):
        engine.scheduler.on_allocated(b, [table], 12)
    assert tier_refs(engine) == [0] * len(tier_refs(engine))
    engine.gpu.free(table)
    engine.check()


def test_holds_load_names_only_the_tables_of_a_live_requests_queued_load() -> None:
    """`holds_load` tells an engine recovering from an interrupt (Ctrl-C) whether the
    outcome of a request's load is on its way: True only for the very block tables
    `on_allocated` queued it into. A request preempted after its load and allocated
    new tables, whose `on_allocated` was cut short, holds none (its earlier load's
    outcome came long ago: waiting for another would hang it); once it finished, it
    holds none for its first tables either (no entry is left behind)."""
    engine = stored_engine()
    b = make_request("b", [*range(12), 7])
    assert engine.admit(b) is not None
    first = engine.tables["b"]
    assert engine.scheduler.holds_load("b", first)
    engine.step()  # the load completes
    engine.preempt("b")
    assert engine.scheduler.lookup(b, 0) == 12
    tables = [engine.gpu.allocate(4)]  # on_allocated(b, tables, 12) never runs
    assert not engine.scheduler.holds_load("b", tables)
    engine.scheduler.on_finished(b, tables, computed=False)  # then aborted
    engine.gpu.free(tables[0][::-1])
    assert not engine.scheduler.holds_load("b", first)
    engine.check()


def test_finishing_a_request_whose_load_is_still_queued_frees_its_gpu_blocks() -> None:
    """SPEC §6.7: nothing not yet issued is kept. A request aborted before its load was
    issued releases the load's pins on its GPU destinations and tier blocks."""
    engine = stored_engine()
    num_free = engine.gpu.num_free()
    b = make_request("b", [*range(12), 7])
    assert engine.admit(b) is not None  # the load of 12 tokens is queued
    engine.finish("b")
    assert engine.gpu.num_free() == num_free
    assert tier_refs(engine) == [0] * len(tier_refs(engine))
    assert engine.step().jobs == ()
    engine.check()


def test_a_load_failure_reported_after_its_request_finished_leaves_nothing_behind() -> None:
    """SPEC §6.8 Beyond: a failed load's request recomputes; one that already finished
    (aborted mid-load) is not remembered as waiting to recompute, and its failure is
    returned to no one (`test_reused_request_ids`)."""
    engine = stored_engine()
    engine.auto_complete = False
    b = make_request("b", [*range(12), 7])
    assert engine.admit(b) is not None
    (load,) = engine.step().jobs
    engine.finish("b")  # aborted while its load is in flight
    engine.worker.fail(load.event_id)
    assert engine.poll().failed_loads == ()
    assert "b" not in engine.scheduler.loads.recompute_next
    assert "b" not in engine.scheduler.loads.allocated
    engine.check()


def test_reset_fails_a_queued_load_spanning_two_tiers_once() -> None:
    """SPEC §6.9: a reset drops never-issued loads; a load with a CPU part and a disk part
    comes back as one failed load of its whole range, counted once."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=4, num_disk=12)
    engine.run(make_request("a", range(12)))
    engine.drain()
    first = keys_of(range(12), 1)[0]
    pool = engine.scheduler.tier_pool
    pool.discard_keys(pool.cached_block(first) or 0)  # block 0 is on disk only
    assert holds(engine, Tier.DISK, first)
    engine.evict_gpu()
    assert engine.admit(make_request("b", [*range(12), 5])) is not None  # two parts queued
    engine.scheduler.take_stats()
    assert engine.scheduler.reset() is True
    assert engine.poll().failed_loads == (FailedLoad("b", 0, 12),)
    assert engine.scheduler.take_stats().num_failed_loads == 1


def test_a_load_event_names_every_request_it_serves() -> None:
    """SPEC §6.4: every queued load joins one event per tier, and the plan maps each
    outstanding load event to all the request ids it serves (the worker turns a finished
    event into those requests)."""
    engine = SimEngine(full_layout(), num_gpu_blocks=24, num_tier_blocks=16)
    engine.run(make_request("a", range(8)))
    engine.run(make_request("z", range(100, 108)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    assert engine.admit(make_request("b", [*range(8), 1])) is not None
    assert engine.admit(make_request("c", [*range(100, 108), 2])) is not None
    plan = engine.step()
    (load,) = [job for job in plan.jobs if job.is_load]
    assert load.num_blocks == 4
    assert plan.load_request_ids == {load.event_id: ("b", "c")}
    assert engine.step().load_request_ids == {load.event_id: ("b", "c")}  # outstanding
    engine.worker.complete(load.event_id)
    assert set(engine.poll().finished_loads) == {"b", "c"}
    assert engine.step().load_request_ids == {}


@pytest.mark.parametrize("by_priority", [False, True], ids=["arrival_order", "priority_order"])
def test_hits_while_a_failed_load_waits_to_recompute(by_priority: bool) -> None:
    """SPEC §6.8 Beyond: while a failed request waits to be allocated again (vLLM 0.33
    keeps reserving its whole recompute meanwhile), `offer` offers no load: its own first
    lookup after the failure answers None (ask again later); a hit looked up after it in
    the same pass (one plan) waits (None); one looked up before it, in an engine that
    orders its queue by priority, recomputes (0). No pin is kept for a hit not offered."""
    engine = stored_engine()
    engine.run(make_request("x", range(100, 112)))  # c's hit (b's failure drops a's keys)
    engine.drain()
    engine.evict_gpu()
    engine.scheduler.loads.recompute_ahead = by_priority
    engine.auto_complete = False
    b = make_request("b", [*range(12), 7])
    assert engine.admit(b) is not None
    (load,) = engine.step().jobs
    engine.worker.fail(load.event_id)
    assert engine.poll().failed_loads == (FailedLoad("b", 0, 12),)
    scheduler = engine.scheduler
    c = make_request("c", [*range(100, 112), 8])

    def offered(request: SimRequest) -> int | None:
        return scheduler.offer(request.request_id, scheduler.lookup(request, 0))

    assert offered(c) == (0 if by_priority else None)  # ahead of b
    assert offered(b) is None  # its first lookup since the failure
    assert offered(c) is None  # behind b
    engine.step()  # the pass ends
    assert offered(c) == (0 if by_priority else None)
    assert offered(b) == 0
    assert offered(c) is None
    assert tier_refs(engine) == [0] * len(tier_refs(engine))
    scheduler.on_allocated(b, engine.tables["b"], 0)  # b recomputes: c's hit is offered
    assert offered(c) == 12
    scheduler.release_lookup("c")
    engine.check()
