"""`ReportOutcome.suspect_gpu_blocks`: the GPU blocks of each failed load whose copy
cannot be trusted, so that an engine keeps the prefix before the first of them."""

from __future__ import annotations

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
