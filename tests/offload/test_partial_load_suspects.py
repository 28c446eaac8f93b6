"""`ReportOutcome.suspect_gpu_blocks`: the GPU blocks of each failed load whose copy
cannot be trusted, so that an engine keeps the prefix before the first of them."""

from __future__ import annotations

import pytest
from sim import SimEngine, full_layout, make_request
from test_partial_load_failures_shared import loads_in_one_event

from kvtier.offload.plan import WorkerReport


def test_a_named_bad_block_is_the_only_suspect_of_its_readers() -> None:
    engine, load = loads_in_one_event(1, {"b": 0, "c": 0, "d": 100})
    event, ids, gpus = load.event_id, load.src_block_ids, load.dst_block_ids
    report = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({ids[1]})})
    outcome = engine.scheduler.apply_report(report)
    # b reads ids[0:2] into gpus[0:2], c the same tier blocks into gpus[2:4].
    assert dict(outcome.suspect_gpu_blocks) == {"b": (gpus[1],), "c": (gpus[3],)}
    engine.worker.in_flight.clear()
    engine.check()


def test_without_names_every_block_of_each_load_is_suspect() -> None:
    engine, load = loads_in_one_event(1, {"b": 0, "c": 100})
    event, gpus = load.event_id, load.dst_block_ids
    outcome = engine.scheduler.apply_report(WorkerReport(failed={event: 1}))
    assert dict(outcome.suspect_gpu_blocks) == {"b": gpus[:2], "c": gpus[2:]}
    engine.worker.in_flight.clear()
    engine.check()


@pytest.mark.parametrize("position", [0, 1])
def test_a_block_named_bad_is_not_loaded_for_a_lookup_pinned_before(position: int) -> None:
    """c looks up (and pins) the same tier blocks as b; b's load then names one bad.
    c is allocated afterwards: its load fails before issue, never reading that block,
    whichever block of the hit it is (not only the first one)."""
    engine = SimEngine(full_layout(), num_gpu_blocks=24, num_tier_blocks=8)
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    b = make_request("b", [*range(8), 90])
    c = make_request("c", [*range(8), 91])
    assert engine.admit(b).num_accepted_tokens == 8
    found = engine.lookup(c)
    assert found.num_offered_tokens == 8
    (load_b,) = engine.step().jobs
    bad = load_b.src_block_ids[position]
    engine.worker.corrupt(load_b.event_id, 0, [bad])
    engine.worker.complete(load_b.event_id)
    assert [f.request_id for f in engine.poll().failed_loads] == ["b"]
    assert engine.scheduler.tier_pool.key(bad) is None
    engine.allocate(c, found)
    assert engine.scheduler.has_unissued_failures()
    plan = engine.step()
    assert not [job for job in plan.jobs if bad in job.src_block_ids]
    assert [f.request_id for f in engine.outcomes[-1].failed_loads] == ["c"]
    engine.check()
