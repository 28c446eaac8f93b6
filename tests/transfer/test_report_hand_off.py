"""The worker keeps the reports it gave until the caller acknowledges them (`peek`, then
`acknowledge`): a caller cut short (Ctrl-C) before it stored a report gets it again from
the next peek, the same, and nothing twice once acknowledged."""

from __future__ import annotations

import logging
import threading

import pytest
from transfer_helpers import GATE_TIMEOUT_S, job, kv_per_layer, make_worker

from kvtier.offload.plan import Tier, TransferPlan, WorkerReport
from kvtier.transfer import WorkerConfig
from kvtier.transfer.lanes import TransferLane

pytestmark = pytest.mark.timeout(60)


def fails() -> None:
    raise OSError("disk gone")


def test_a_lane_reports_finished_jobs_again_until_they_are_acknowledged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lane = TransferLane("test")
    gate = threading.Event()
    lane.submit(1, lambda: None)
    lane.submit(2, fails)
    lane.submit(3, lambda: gate.wait(GATE_TIMEOUT_S) and None)
    lane.submit(4, lambda: None)
    while len(lane.reported_event_ids()) < 2:
        with caplog.at_level(logging.WARNING, logger="kvtier.transfer.lanes"):
            done, failed = lane.finished()
    assert (list(done), list(failed)) == ([1], [2])
    again = lane.finished()
    assert again == (done, failed)  # the same copy time, the same error object
    assert again[1][2] is failed[2]
    assert caplog.text.count("transfer event 2 failed") == 1  # logged once
    gate.set()
    lane.wait_all()  # 3 and 4 finish after the last report: acknowledge keeps them
    lane.acknowledge()
    assert lane.pending_event_ids() == [3, 4]
    assert lane.reported_event_ids() == []
    done, failed = lane.finished()
    assert (list(done), failed) == ([3, 4], {})
    lane.acknowledge()
    assert lane.finished() == ({}, {})
    assert lane.num_pending == 0
    lane.close()


def test_a_worker_peek_is_repeated_until_acknowledged_and_poll_lets_go_at_once() -> None:
    kv = kv_per_layer(2, num_blocks=8)
    worker = make_worker(WorkerConfig(cpu_num_slots=8), kv)
    store = job(1, Tier.GPU, Tier.CPU, [1], [1])
    load = job(2, Tier.CPU, Tier.GPU, [5], [2])  # slot 5 holds no data: still copied
    worker.submit(TransferPlan(step_id=0, jobs=(store, load)))
    worker.flush()
    first = worker.peek()
    worker.check_invariants()
    assert (first.done, first.failed) == ({1: 1, 2: 1}, {})
    # Each done event carries the seconds its copies took (s33 mutant: none reported).
    assert set(first.seconds) == {1, 2}
    assert all(isinstance(s, float) and 0 <= s < 60 for s in first.seconds.values())
    assert worker.peek() == first  # a caller cut short before it stored the report
    worker.submit(TransferPlan(step_id=1, jobs=(job(3, Tier.GPU, Tier.CPU, [3], [3]),)))
    worker.flush()
    assert worker.peek().done == {1: 1, 2: 1, 3: 1}
    worker.acknowledge()
    worker.check_invariants()
    assert worker.peek() == WorkerReport()
    worker.submit(TransferPlan(step_id=2, jobs=(job(4, Tier.GPU, Tier.CPU, [4], [4]),)))
    worker.flush()
    assert worker.poll().done == {4: 1}
    assert worker.peek() == WorkerReport()
    worker.shutdown()


def test_an_event_peeked_and_not_acknowledged_cannot_be_submitted_again() -> None:
    """Regression: `peek` takes an event out of the in-flight set while its lane still
    holds its report, so `submit` accepted its id again: two pending jobs of one event,
    and the next peek handed the old job's report out as the new one's."""
    kv = kv_per_layer(1, num_blocks=8)
    with make_worker(WorkerConfig(cpu_num_slots=8), kv) as worker:
        worker.submit(TransferPlan(step_id=0, jobs=(job(1, Tier.GPU, Tier.CPU, [1], [1]),)))
        worker.flush()
        assert worker.peek().done == {1: 1}
        again = job(1, Tier.CPU, Tier.GPU, [1], [2])
        with pytest.raises(ValueError, match="event 1"):
            worker.submit(TransferPlan(step_id=1, jobs=(again,)))
        worker.check_invariants()
        worker.acknowledge()
        worker.submit(TransferPlan(step_id=2, jobs=(again,)))  # reported and acknowledged
        worker.flush()
        assert worker.poll().done == {1: 1}
        worker.check_invariants()
