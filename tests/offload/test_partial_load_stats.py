"""Transfer statistics of a failed load event (docs/load_failures.md).

A failed load whose workers named its bad blocks copied every other block whole: those
blocks' bytes and the copy time the workers reported count under the event's direction.
A failure that names nothing counts neither, as before.
"""

from __future__ import annotations

from test_partial_load_failures_shared import loads_in_one_event

from kvtier.offload.plan import WorkerReport
from kvtier.offload.stats import OffloadStats


def bytes_per_block(stats: OffloadStats) -> int:
    assert stats.num_loaded_blocks
    return stats.num_bytes_loaded // stats.num_loaded_blocks


def test_a_partly_failed_load_counts_the_blocks_it_copied_and_their_time() -> None:
    engine, load = loads_in_one_event(1, {"b": 0, "c": 100})
    event, ids = load.event_id, load.src_block_ids
    kind = f"{load.src_tier.value}_to_GPU"
    report = WorkerReport(
        failed={event: 1}, seconds={event: 0.25}, bad_blocks={event: frozenset({ids[2]})}
    )
    engine.scheduler.take_stats()  # the stores before
    engine.scheduler.apply_report(report)
    stats = engine.scheduler.take_stats()
    assert dict(stats.transfer_bytes) == {kind: 3 * bytes_per_block(stats)}
    assert dict(stats.transfer_seconds) == {kind: 0.25}
    engine.worker.in_flight.clear()
    engine.check()


def test_a_bad_block_two_loads_read_is_not_counted_and_the_slowest_worker_times_it() -> None:
    engine, load = loads_in_one_event(2, {"b": 0, "c": 0, "d": 100})
    event, ids = load.event_id, load.src_block_ids
    assert len(ids) == 6
    assert ids[:2] == ids[2:4]  # b and c read the same two blocks
    kind = f"{load.src_tier.value}_to_GPU"
    done = WorkerReport(done={event: 1}, seconds={event: 0.5})
    named = WorkerReport(
        failed={event: 1}, seconds={event: 0.75}, bad_blocks={event: frozenset({ids[0]})}
    )
    engine.scheduler.take_stats()
    engine.scheduler.apply_report(WorkerReport.merge([done, named]))
    stats = engine.scheduler.take_stats()
    assert stats.num_loaded_blocks == 2  # d's load; b's and c's are recomputed
    assert dict(stats.transfer_bytes) == {kind: 4 * bytes_per_block(stats)}
    assert dict(stats.transfer_seconds) == {kind: 0.75}
    engine.worker.in_flight.clear()
    engine.check()


def test_a_failure_naming_nothing_counts_no_bytes_and_no_time() -> None:
    engine, load = loads_in_one_event(2, {"b": 0, "c": 100})
    event = load.event_id
    done = WorkerReport(done={event: 1}, seconds={event: 0.5})
    unnamed = WorkerReport(failed={event: 1}, seconds={event: 0.5})
    engine.scheduler.take_stats()
    engine.scheduler.apply_report(WorkerReport.merge([done, unnamed]))
    stats = engine.scheduler.take_stats()
    assert (dict(stats.transfer_bytes), dict(stats.transfer_seconds)) == ({}, {})
    assert stats.num_failed_loads == 2
    engine.worker.in_flight.clear()
    engine.check()
