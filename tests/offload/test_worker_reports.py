"""Worker reports the scheduler must refuse or ignore without corrupting its state (SPEC §6.8).

Unknown or already reported event ids are ignored with a warning; a count that is not a
worker count refuses the whole report; an event more workers reported than there are
completes as failed (registers nothing, its load is recomputed).
"""

from __future__ import annotations

import logging

import pytest
from sim import SimEngine, block_key, full_layout, make_request

from kvtier.offload.plan import WorkerReport
from kvtier.offload.transfers import FailedLoad, ReportOutcome


def engine_with_a_store(num_workers: int = 1) -> tuple[SimEngine, int]:
    """Return an engine with one finish-time store in flight, and its event id."""
    engine = SimEngine(full_layout(), num_workers=num_workers)
    store = engine.store_of_finished(make_request("a", range(8)))
    return engine, store.event_id


def test_unknown_and_repeated_event_ids_are_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, event_id = engine_with_a_store()
    scheduler = engine.scheduler
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.transfers"):
        scheduler.apply_report(WorkerReport(done={event_id + 100: 1}, failed={-5: 1}))
    assert "not in flight" in caplog.text
    assert scheduler.has_pending_stores()
    engine.worker.complete(event_id)
    engine.poll()
    key = block_key(engine.layout, make_request("x", range(8)), 0, 0)
    slot = scheduler.tier_pool.cached_block(key)
    assert slot is not None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.transfers"):
        outcome = scheduler.apply_report(WorkerReport(done={event_id: 1}, failed={event_id: 1}))
    assert outcome.failed_loads == outcome.finished_loads == ()
    assert str(event_id) in caplog.text
    assert scheduler.tier_pool.cached_block(key) == slot
    assert scheduler.tier_pool.ref_count(slot) == 0
    engine.check()


@pytest.mark.parametrize("count", [-1, 1.0, "1", True, None])
def test_a_report_with_a_bad_count_is_refused_whole(count: object) -> None:
    engine, event_id = engine_with_a_store()
    scheduler = engine.scheduler
    report = WorkerReport(done={event_id: 1}, failed={event_id + 1: count})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=rf"failed\[{event_id + 1}\]"):
        scheduler.apply_report(report)
    assert scheduler.has_pending_stores()  # the valid part was not applied either
    engine.check()
    engine.worker.complete(event_id)
    engine.poll()
    assert not scheduler.has_pending_stores()
    engine.check()


@pytest.mark.parametrize("seconds", [-0.5, float("nan"), float("inf"), "1", None, True])
def test_a_bad_copy_time_is_ignored_with_a_warning_and_the_counts_apply(
    seconds: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy time is a statistic: a bad one must not hold back the store it came with."""
    engine, event_id = engine_with_a_store()
    scheduler = engine.scheduler
    report = WorkerReport(done={event_id: 1}, seconds={event_id: seconds})  # type: ignore[dict-item]
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.transfers"):
        scheduler.apply_report(report)
    assert f"seconds[{event_id}]" in caplog.text
    assert not scheduler.has_pending_stores()
    assert scheduler.take_stats().transfer_seconds == {"GPU_to_CPU": 0.0}
    engine.check()


def test_merged_reports_sum_worker_counts_and_keep_each_events_slowest_time() -> None:
    merged = WorkerReport.merge(
        [
            WorkerReport(done={1: 1, 2: 1}, seconds={1: 0.3, 2: 0.1}),
            WorkerReport(done={1: 1}, failed={3: 1}, seconds={1: 0.7}),
        ]
    )
    assert merged == WorkerReport(done={1: 2, 2: 1}, failed={3: 1}, seconds={1: 0.7, 2: 0.1})


def test_a_store_reported_by_more_workers_than_there_are_registers_nothing() -> None:
    engine, event_id = engine_with_a_store(num_workers=2)
    scheduler = engine.scheduler
    scheduler.apply_report(WorkerReport(done={event_id: 3}))  # one worker reported twice
    assert not scheduler.has_pending_stores()
    assert scheduler.tier_pool.num_free() == scheduler.tier_pool.num_usable_blocks
    assert scheduler.take_stats().num_failed_stores == 2  # blocks
    engine.worker.in_flight.clear()  # the fake workers' own view of the event is moot
    engine.check()


def test_a_load_reported_by_more_workers_than_there_are_is_recomputed() -> None:
    engine = SimEngine(full_layout(), num_workers=2)
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    engine.admit(make_request("b", [*range(8), 9]))
    (load,) = engine.step().jobs
    outcome = engine.scheduler.apply_report(WorkerReport(done={load.event_id: 3}))
    assert outcome.finished_loads == ()
    assert outcome.failed_loads == (FailedLoad("b", 0, 8),)
    engine.worker.in_flight.clear()
    engine.check()


def test_one_report_with_a_done_and_a_failed_worker_completes_the_store_once_as_failed() -> None:
    """SPEC §6.8: worker counts add up across the done and failed maps; with every worker
    reported in one report (one copied, one failed), the store completes once, as failed:
    it registers nothing and frees its slots."""
    engine, event_id = engine_with_a_store(num_workers=2)
    scheduler = engine.scheduler
    outcome = scheduler.apply_report(WorkerReport(done={event_id: 1}, failed={event_id: 1}))
    assert outcome == ReportOutcome()
    assert not scheduler.has_pending_stores()
    assert scheduler.tier_pool.num_free() == scheduler.tier_pool.num_usable_blocks
    assert scheduler.take_stats().num_failed_stores == 2  # blocks
    engine.worker.in_flight.clear()  # the fake workers' own view of the event is moot
    engine.check()
