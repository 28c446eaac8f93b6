"""What `PlanAssembler.build` puts in each plan (SPEC §6.4): one load event per tier
whose `load_parts` follow its requests' order, and step ids that never repeat."""

from __future__ import annotations

from sim import SimEngine, full_layout, make_request

from kvtier.offload.plan import WorkerReport


def test_load_parts_pair_each_request_with_its_own_blocks() -> None:
    """b loads 1 block, c 2, in one event: `load_parts` (1, 2) tells a worker which
    request read which source block (docs/load_failures.md). A bad block of c's fails
    c alone; parts in another order would fail b and let c use the bad KV."""
    engine = SimEngine(full_layout())
    engine.run(make_request("a1", range(4)))
    engine.run(make_request("a2", range(100, 108)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    assert engine.admit(make_request("b", [*range(4), 50])).num_accepted_tokens == 4
    assert engine.admit(make_request("c", [*range(100, 108), 51])).num_accepted_tokens == 8
    plan = engine.step()
    (load,) = [job for job in plan.jobs if job.is_load]
    assert plan.load_request_ids[load.event_id] == ("b", "c")
    assert load.load_parts == (1, 2)
    bad = load.src_block_ids[1]  # c's first block
    report = WorkerReport(failed={load.event_id: 1}, bad_blocks={load.event_id: frozenset({bad})})
    outcome = engine.scheduler.apply_report(report)
    assert [f.request_id for f in outcome.failed_loads] == ["c"]
    assert outcome.finished_loads == ("b",)
    engine.worker.in_flight.clear()
    engine.check()


def test_each_plan_has_the_next_step_id() -> None:
    """A worker tells its plans apart by step id (the vLLM adapter's redelivery keys
    its outputs by it): each plan's is one more than the last's, from 1."""
    engine = SimEngine(full_layout())
    assert [engine.step().step_id for _ in range(3)] == [1, 2, 3]
