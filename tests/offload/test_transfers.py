"""How `TransferBook` adds up worker reports of an issued event (`offload/transfers.py`,
SPEC §6.8): worker counts, the bad blocks failing workers name, and what a failed event
counts or leaves in flight."""

from __future__ import annotations

from typing import Any

import pytest
from sim import block_key, make_request
from test_completion import interrupt_after_noting
from test_partial_load_failures_shared import loads_in_one_event
from test_scenarios_cascade import demotion_in_flight
from test_scenarios_lifecycle import loading_engine
from test_worker_reports import engine_with_a_store

from kvtier.offload.plan import Tier, TransferJob, WorkerReport
from kvtier.offload.transfers import FailedLoad, IssuedTransfer, TransferBook


@pytest.mark.parametrize("named_first", [False, True], ids=["unnamed-first", "named-first"])
def test_a_failure_naming_nothing_makes_every_block_suspect_whatever_another_names(
    named_first: bool,
) -> None:
    """Two workers fail b's and c's load event: one names c's first block, the other
    names nothing. Nothing is known to be whole, so both loads fail whole, in either
    order of the reports (a mutant crashed on the named report after the unnamed one)."""
    engine, load = loads_in_one_event(2, {"b": 0, "c": 100})
    event, ids = load.event_id, load.src_block_ids
    named = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({ids[2]})})
    unnamed = WorkerReport(failed={event: 1})
    reports = [named, unnamed] if named_first else [unnamed, named]
    assert engine.scheduler.apply_report(reports[0]).failed_loads == ()
    outcome = engine.scheduler.apply_report(reports[1])
    assert outcome.finished_loads == ()
    assert outcome.failed_loads == (FailedLoad("b", 0, 8), FailedLoad("c", 0, 8))
    assert all(failure.whole for failure in outcome.failed_loads)
    engine.worker.in_flight.clear()
    engine.check()


def test_a_merged_report_counting_every_worker_failed_completes_the_event() -> None:
    """`WorkerReport.merge` adds the workers' counts: failed by both of 2 workers in
    one report, the event completes, and both loads fail (a mutant counting one worker
    per report left it in flight for good: the requests waited forever)."""
    engine, load = loads_in_one_event(2, {"b": 0, "c": 100})
    outcome = engine.scheduler.apply_report(WorkerReport(failed={load.event_id: 2}))
    assert {failure.request_id for failure in outcome.failed_loads} == {"b", "c"}
    assert not engine.scheduler.is_in_flight(load.event_id)
    engine.worker.in_flight.clear()
    engine.check()


def test_a_failed_count_of_zero_is_no_failure() -> None:
    """A report may list an event with no failing worker (count 0): it names no bad
    blocks, yet makes nothing suspect; the one worker's later failure naming c's block
    fails c alone (a mutant took the zero count for a failure naming nothing: b failed
    too)."""
    engine, load = loads_in_one_event(1, {"b": 0, "c": 100})
    event, ids = load.event_id, load.src_block_ids
    assert engine.scheduler.apply_report(WorkerReport(failed={event: 0})).failed_loads == ()
    assert engine.scheduler.is_in_flight(event)
    named = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({ids[2]})})
    outcome = engine.scheduler.apply_report(named)
    assert outcome.finished_loads == ("b",)
    assert outcome.failed_loads == (FailedLoad("c", 0, 8),)
    engine.worker.in_flight.clear()
    engine.check()


def test_a_failed_store_naming_its_bad_blocks_counts_no_transfer() -> None:
    """Named bad blocks tell which blocks of a failed load were copied whole; a failed
    store registers nothing, so none of its blocks counts as transferred."""
    engine, event_id = engine_with_a_store()
    (store,) = [job for job in engine.worker.stores() if job.event_id == event_id]
    bad = frozenset({store.src_block_ids[0]})
    engine.scheduler.take_stats()
    report = WorkerReport(failed={event_id: 1}, bad_blocks={event_id: bad})
    assert engine.scheduler.apply_report(report).failed_loads == ()
    stats = engine.scheduler.take_stats()
    assert stats.num_failed_stores == store.num_blocks
    assert dict(stats.transfer_bytes) == {}
    engine.worker.in_flight.clear()
    engine.check()


def test_the_book_refuses_load_parts_on_an_event_without_loads() -> None:
    """A job whose `load_parts` name requests the event does not carry would let a
    worker fail requests that read none of its blocks."""
    job = TransferJob(8, Tier.CPU, Tier.GPU, (1, 2), (101, 102), load_parts=(2,))
    with pytest.raises(ValueError, match=r"load parts \(2,\) are not the block counts \(\)"):
        TransferBook(1).issue(IssuedTransfer(job))


def test_a_demotion_a_reset_abandoned_counts_as_abandoned() -> None:
    """`store_events_in_flight` (for the engine's drain messages): a demotion in flight
    at a reset is one event, abandoned."""
    engine, _ = demotion_in_flight()
    assert engine.scheduler.store_events_in_flight() == (1, 0)
    assert engine.scheduler.reset() is False
    assert engine.scheduler.store_events_in_flight() == (1, 1)
    engine.worker.in_flight.clear()


def test_a_report_after_an_apply_cut_short_leaves_the_counted_event_as_counted() -> None:
    """A Ctrl-C cut short the apply of a's completed store before any of its steps ran;
    a worker's report of the same event (as failed) arrives before the next apply. The
    event was counted complete and succeeded: the report is ignored, the store registers
    a's blocks (a mutant counted it again: the store turned failed mid-apply)."""
    engine, event_id = engine_with_a_store()
    completion: Any = engine.scheduler._completion
    apply_steps = completion._apply_steps
    interrupted: list[bool] = []

    def applying(*args: Any) -> None:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        apply_steps(*args)

    completion._apply_steps = applying
    with pytest.raises(KeyboardInterrupt):
        engine.scheduler.apply_report(WorkerReport(done={event_id: 1}))
    engine.scheduler.apply_report(WorkerReport(failed={event_id: 1}))
    key = block_key(engine.layout, make_request("x", range(8)), 0, 0)
    assert engine.scheduler.tier_pool.cached_block(key) is not None
    assert engine.scheduler.take_stats().num_failed_stores == 0
    engine.worker.in_flight.clear()
    engine.check()


def test_a_load_applied_in_part_pins_no_gpu_block() -> None:
    """`holds_gpu_blocks_alone` (vLLM's `has_pending_block_frees`): once an apply cut
    short released b's load pins, b alone holds its blocks; the event still in the book
    pins none of them (a mutant counted its released pins: the engine waited for frees
    no report brings)."""
    engine, _ = loading_engine()
    (load,) = engine.step().jobs
    interrupt_after_noting(engine)
    with pytest.raises(KeyboardInterrupt):
        engine.scheduler.apply_report(WorkerReport(done={load.event_id: 1}))
    assert engine.scheduler.is_in_flight(load.event_id)
    assert not engine.scheduler.holds_gpu_blocks_alone()
    assert engine.scheduler.apply_report(WorkerReport()).finished_loads == ("b",)
    engine.check()
