"""A load event reported by more workers than there are, one of them naming bad blocks
(SPEC §6.8, docs/load_failures.md): which workers copied it is unknown, so the names do
not narrow the failure: every load of the event fails and every block is suspect."""

from __future__ import annotations

import logging

import pytest
from test_partial_load_failures import keyed, two_loads_in_one_event

from kvtier.offload.plan import WorkerReport


def test_an_overreported_event_fails_whole_despite_named_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, load = two_loads_in_one_event(num_workers=2)
    event, ids = load.event_id, load.src_block_ids
    named = {event: frozenset({ids[2]})}  # c's first block
    report = WorkerReport(done={event: 2}, failed={event: 1}, bad_blocks=named)
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.transfers"):
        outcome = engine.scheduler.apply_report(report)
    assert "reported by 3 workers of 2" in caplog.text
    assert outcome.finished_loads == ()
    assert {f.request_id for f in outcome.failed_loads} == {"b", "c"}
    assert all(f.whole for f in outcome.failed_loads)
    assert keyed(engine, load) == []
    assert engine.scheduler.take_stats().num_loaded_blocks == 0
    engine.worker.in_flight.clear()
    engine.check()
