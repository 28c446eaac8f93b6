"""Named bad blocks read by two loads of one event, and named after a reset.

b and c share an 8-token prefix (tier blocks x, y) and load it in one event beside d:
a bad block fails both its readers, keeps d's load and every other block's key, and
frees each pin once (`check_invariants` after every report). A report naming a bad
block that arrives after a reset completes the reset and keeps nothing.
"""

from __future__ import annotations

import pytest
from sim import SimEngine, full_layout, make_request

from kvtier.offload.plan import TransferJob, WorkerReport

PREFIX = 8


def loads_in_one_event(num_workers: int, requests: dict[str, int]) -> tuple[SimEngine, TransferJob]:
    """Store prefixes 0.. and 100.., evict them, admit `requests` (id -> prefix start),
    and return the engine with the one load event of its next plan, not yet completed."""
    engine = SimEngine(full_layout(), num_workers=num_workers)
    engine.run(make_request("a1", range(PREFIX)))
    engine.run(make_request("a2", range(100, 100 + PREFIX)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    for i, (request_id, start) in enumerate(requests.items()):
        engine.admit(make_request(request_id, [*range(start, start + PREFIX), 50 + i]))
    (load,) = [job for job in engine.step().jobs if job.is_load]
    return engine, load


def readers(job: TransferJob, request_ids: tuple[str, ...], block: int) -> set[str]:
    found, start = set(), 0
    for request_id, size in zip(request_ids, job.load_parts, strict=True):
        if block in job.src_block_ids[start : start + size]:
            found.add(request_id)
        start += size
    return found


@pytest.mark.parametrize("bad_index", [0, 1])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_bad_block_two_loads_read_fails_both_and_keeps_the_rest(
    bad_index: int, num_workers: int
) -> None:
    engine, load = loads_in_one_event(num_workers, {"b": 0, "c": 0, "d": 100})
    ids, event = load.src_block_ids, load.event_id
    assert ids[:2] == ids[2:4]  # b and c read the same tier blocks
    bad = ids[bad_index]
    scheduler = engine.scheduler
    named = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({bad})})
    for report in [named] + [WorkerReport(done={event: 1})] * (num_workers - 1):
        outcome = scheduler.apply_report(report)
        scheduler.check_invariants()
    assert {f.request_id for f in outcome.failed_loads} == readers(load, ("b", "c", "d"), bad)
    assert {f.request_id for f in outcome.failed_loads} == {"b", "c"}
    assert outcome.finished_loads == ("d",)
    pool = scheduler.tier_pool
    assert {b for b in ids if pool.key(b) is not None} == set(ids) - {bad}
    engine.worker.in_flight.clear()
    engine.check()


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_named_report_after_a_reset_completes_it(num_workers: int) -> None:
    engine, load = loads_in_one_event(num_workers, {"b": 0, "d": 100})
    scheduler = engine.scheduler
    assert scheduler.reset() is False
    scheduler.check_invariants()
    event = load.event_id
    named = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({load.src_block_ids[0]})})
    for _ in range(num_workers):
        outcome = scheduler.apply_report(named)
        scheduler.check_invariants()
    assert (outcome.finished_loads, [f.request_id for f in outcome.failed_loads]) == (("d",), ["b"])
    assert scheduler.reset() is True
    assert all(scheduler.tier_pool.key(b) is None for b in load.src_block_ids)
    engine.worker.in_flight.clear()
    engine.check()
