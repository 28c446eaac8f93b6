"""A failed load event whose workers named its bad blocks (SPEC §6.8, docs/load_failures.md).

Only the loads reading a bad block fail (and are recomputed); only the bad blocks' keys
are dropped; the event's other loads finish. Without names from every failing worker,
or with names that are not source blocks of the event, the whole event fails as before.
"""

from __future__ import annotations

import logging

import pytest
from sim import SimEngine
from test_partial_load_failures_shared import loads_in_one_event

from kvtier.offload.plan import Tier, TransferJob, WorkerReport
from kvtier.offload.transfers import FailedLoad, IssuedTransfer

PREFIX = 8  # tokens: two 4-token blocks per request


def two_loads_in_one_event(num_workers: int = 1) -> tuple[SimEngine, TransferJob]:
    """Return an engine whose next plan loads requests b (first) and c in one event."""
    return loads_in_one_event(num_workers, {"b": 0, "c": 100})


def keyed(engine: SimEngine, job: TransferJob) -> list[int]:
    pool = engine.scheduler.tier_pool
    return [b for b in job.src_block_ids if pool.key(b) is not None]


def test_only_the_load_reading_a_bad_block_fails() -> None:
    engine, load = two_loads_in_one_event()
    assert len(load.src_block_ids) == 4  # b's two blocks, then c's two
    bad = load.src_block_ids[2]  # c's first block
    report = WorkerReport(failed={load.event_id: 1}, bad_blocks={load.event_id: frozenset({bad})})
    outcome = engine.scheduler.apply_report(report)
    assert outcome.finished_loads == ("b",)
    assert outcome.failed_loads == (FailedLoad("c", 0, PREFIX),)
    assert keyed(engine, load) == [b for b in load.src_block_ids if b != bad]
    stats = engine.scheduler.take_stats()
    assert (stats.num_failed_loads, stats.num_loaded_blocks) == (1, 2)
    engine.worker.in_flight.clear()
    engine.check()


def test_without_named_blocks_the_whole_event_fails() -> None:
    engine, load = two_loads_in_one_event()
    outcome = engine.scheduler.apply_report(WorkerReport(failed={load.event_id: 1}))
    assert outcome.finished_loads == ()
    assert {f.request_id for f in outcome.failed_loads} == {"b", "c"}
    assert keyed(engine, load) == []
    engine.worker.in_flight.clear()
    engine.check()


@pytest.mark.parametrize("named", [frozenset(), frozenset({10_000})], ids=["none", "foreign"])
def test_names_that_are_not_source_blocks_fail_the_whole_event(
    named: frozenset[int], caplog: pytest.LogCaptureFixture
) -> None:
    engine, load = two_loads_in_one_event()
    report = WorkerReport(failed={load.event_id: 1}, bad_blocks={load.event_id: named})
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.transfers"):
        outcome = engine.scheduler.apply_report(report)
    assert "every block is suspect" in caplog.text
    assert {f.request_id for f in outcome.failed_loads} == {"b", "c"}
    assert keyed(engine, load) == []
    engine.worker.in_flight.clear()
    engine.check()


def test_two_workers_naming_blocks_of_both_loads_fail_both_keeping_the_good_blocks() -> None:
    engine, load = two_loads_in_one_event(num_workers=2)
    event, ids = load.event_id, load.src_block_ids
    scheduler = engine.scheduler
    first = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({ids[1]})})
    assert scheduler.apply_report(first).failed_loads == ()  # one worker of two
    second = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({ids[2]})})
    outcome = scheduler.apply_report(second)
    assert {f.request_id for f in outcome.failed_loads} == {"b", "c"}
    assert keyed(engine, load) == [ids[0], ids[3]]
    engine.worker.in_flight.clear()
    engine.check()


def test_one_worker_of_two_failing_without_names_fails_the_whole_event() -> None:
    engine, load = two_loads_in_one_event(num_workers=2)
    event, ids = load.event_id, load.src_block_ids
    scheduler = engine.scheduler
    named = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({ids[0]})})
    scheduler.apply_report(named)
    outcome = scheduler.apply_report(WorkerReport(failed={event: 1}))
    assert {f.request_id for f in outcome.failed_loads} == {"b", "c"}
    assert keyed(engine, load) == []
    engine.worker.in_flight.clear()
    engine.check()


def test_a_done_worker_and_a_naming_worker_fail_only_the_bad_load() -> None:
    engine, load = two_loads_in_one_event(num_workers=2)
    event, ids = load.event_id, load.src_block_ids
    report = WorkerReport.merge(
        [
            WorkerReport(done={event: 1}),
            WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({ids[0]})}),
        ]
    )
    outcome = engine.scheduler.apply_report(report)
    assert (outcome.finished_loads, outcome.failed_loads) == (("c",), (FailedLoad("b", 0, 8),))
    engine.worker.in_flight.clear()
    engine.check()


def test_named_blocks_of_an_event_the_report_does_not_fail_refuse_it() -> None:
    engine, load = two_loads_in_one_event()
    event = load.event_id
    report = WorkerReport(done={event: 1}, bad_blocks={event: frozenset({load.src_block_ids[0]})})
    with pytest.raises(ValueError, match="does not fail"):
        engine.scheduler.apply_report(report)
    bad = WorkerReport(failed={event: 1}, bad_blocks={event: {1}})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="not a frozenset"):
        engine.scheduler.apply_report(bad)
    assert engine.scheduler.apply_report(WorkerReport(done={event: 1})).finished_loads == ("b", "c")
    engine.worker.in_flight.clear()
    engine.check()


def test_named_blocks_of_a_zero_count_failure_or_of_other_types_refuse_the_report() -> None:
    """A failure count of 0 fails no worker's copy: blocks named for it are refused as
    for an event not failed; so are names that are not block ids (mutants took both)."""
    engine, load = two_loads_in_one_event()
    event = load.event_id
    named = frozenset({load.src_block_ids[0]})
    zero = WorkerReport(done={event: 1}, failed={event: 0}, bad_blocks={event: named})
    with pytest.raises(ValueError, match="does not fail"):
        engine.scheduler.apply_report(zero)
    text = WorkerReport(failed={event: 1}, bad_blocks={event: frozenset({"1"})})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="not a frozenset"):
        engine.scheduler.apply_report(text)
    assert engine.scheduler.apply_report(WorkerReport(done={event: 1})).finished_loads == ("b", "c")
    engine.worker.in_flight.clear()
    engine.check()


def test_merge_unites_named_blocks_only_when_every_failure_named_its_own() -> None:
    named = [
        WorkerReport(failed={1: 1, 2: 1}, bad_blocks={1: frozenset({3}), 2: frozenset({4})}),
        WorkerReport(failed={1: 1}, bad_blocks={1: frozenset({5})}),
        WorkerReport(done={2: 1}),
    ]
    merged = WorkerReport.merge(named)
    assert merged.failed == {1: 2, 2: 1}
    assert merged.bad_blocks == {1: frozenset({3, 5}), 2: frozenset({4})}
    with_unnamed = WorkerReport.merge([*named, WorkerReport(failed={2: 1})])
    assert with_unnamed.bad_blocks == {1: frozenset({3, 5})}
    # Associative, as vLLM aggregates ranks' metadata pairwise in any grouping.
    left = WorkerReport.merge([WorkerReport.merge(named[:2]), WorkerReport(failed={2: 1})])
    right = WorkerReport.merge(
        [named[0], WorkerReport.merge([named[1], WorkerReport(failed={2: 1})])]
    )
    assert left.bad_blocks == right.bad_blocks == {1: frozenset({3, 5})}


def test_a_failure_that_named_nothing_leaves_every_block_suspect() -> None:
    """An event counted failed without any `note_failure` naming blocks (a count set some
    other way) must not read as "no block suspect": that would finish its loads."""
    job = TransferJob(5, Tier.DISK, Tier.GPU, (1, 2), (3, 4), load_parts=(2,))
    transfer = IssuedTransfer(job, num_failed=1)
    assert transfer.suspect([1, 2]) == [1, 2]
    transfer.note_failure(frozenset({2}))
    assert transfer.suspect([1, 2]) == [2]
    assert IssuedTransfer(job).suspect([1, 2]) == []
