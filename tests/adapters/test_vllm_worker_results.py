"""What one rank hands vLLM for an output vLLM dropped, sent again (`worker_results`,
`redelivery`): a failed load stays failed and a load failed by block keeps its suspect
blocks, or vLLM would serve KV that never arrived (one worker, faked transfer reports)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import lone_worker

from kvtier.adapters.vllm.metadata import KVTierMetadata
from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport

SLOTS = (5, 6, 7, 8)
DST = (9, 10, 11, 14)


@pytest.fixture
def connector() -> Iterator[Any]:
    with lone_worker() as worker:
        yield worker.connector


def fake_reports(connector: Any, *reports: WorkerReport) -> None:
    """Have the offload worker report `reports`, one a poll, in place of its copies'."""
    offload = connector.worker_side.worker
    queue = list(reports)
    offload.poll = lambda: queue.pop(0) if queue else WorkerReport()


def step(connector: Any, plan: TransferPlan, processed_step: int = 0) -> tuple[Any, ...]:
    """Run one step as vLLM's model runner does; return (finished, failed, invalid
    blocks, worker metadata)."""
    connector.bind_connector_metadata(KVTierMetadata(plan, processed_step=processed_step))
    connector.start_load_kv(None)
    connector.wait_for_save()
    results = connector.get_transfer_results(set())
    invalid = connector.get_block_ids_with_load_errors()
    meta = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    return results.finished_recving, results.failed_recving, invalid, meta


def load_plan(parts: tuple[int, ...] = ()) -> TransferPlan:
    load = TransferJob(1, Tier.CPU, Tier.GPU, SLOTS, DST, load_parts=parts)
    return TransferPlan(step_id=1, jobs=(load,), load_request_ids={1: ("r",)})


def test_a_failed_load_of_a_dropped_output_is_handed_to_vllm_again_as_failed(
    connector: Any,
) -> None:
    plan = load_plan()
    fake_reports(connector, WorkerReport(failed={1: 1}))
    finished, failed, invalid, meta = step(connector, plan)
    assert (finished, failed, invalid) == ({"r"}, {"r"}, set())
    assert meta.report.failed == {1: 1}
    # vLLM dropped that output; the scheduler has since applied a later step's outputs
    finished, failed, invalid, meta = step(connector, TransferPlan(2), processed_step=1)
    assert (finished, failed, invalid) == ({"r"}, {"r"}, set())
    assert meta.report.failed == {1: 1}


def test_a_load_failed_by_block_of_a_dropped_output_keeps_its_suspect_blocks(
    connector: Any,
) -> None:
    """One full-attention group: the worker names bad source block SLOTS[1], so r is
    finished with GPU block DST[1] as its load error, and must be again when sent again."""
    plan = load_plan(parts=(len(SLOTS),))
    fake_reports(connector, WorkerReport(failed={1: 1}, bad_blocks={1: frozenset(SLOTS[1:2])}))
    finished, failed, invalid, _ = step(connector, plan)
    assert (finished, failed, invalid) == ({"r"}, set(), {DST[1]})
    finished, failed, invalid, meta = step(connector, TransferPlan(2), processed_step=1)
    assert (finished, failed, invalid) == ({"r"}, set(), {DST[1]})
    assert meta.report.bad_blocks == {1: frozenset(SLOTS[1:2])}


def test_nothing_is_handed_over_while_the_forward_s_exception_propagates(
    connector: Any,
) -> None:
    """vLLM's model runner calls these in a `finally` and drops that step's output: what
    finished is handed over in the next step instead."""
    plan = load_plan()
    fake_reports(connector, WorkerReport(failed={1: 1}))
    connector.bind_connector_metadata(KVTierMetadata(plan))
    connector.start_load_kv(None)
    try:
        raise RuntimeError("the forward raised")
    except RuntimeError:
        results = connector.get_transfer_results(set())
        assert connector.get_block_ids_with_load_errors() == set()
        assert connector.build_connector_worker_meta() is None
    assert not results.finished_recving
    assert not results.failed_recving
    connector.clear_connector_metadata()
    still_listed = TransferPlan(2, load_request_ids={1: ("r",)})
    finished, failed, invalid, meta = step(connector, still_listed)
    assert (finished, failed, invalid) == ({"r"}, {"r"}, set())
    assert meta.report.failed == {1: 1}
    assert meta.failed_forward_step == 1


def test_results_taken_twice_before_the_worker_metadata_are_all_reported(
    connector: Any,
) -> None:
    """Should a connector call between the two raise (vLLM then drops the output), the
    next step's metadata still reports the first poll's events: else their pins stay."""
    fake_reports(connector, WorkerReport(done={7: 1}), WorkerReport(done={8: 1}))
    connector.bind_connector_metadata(KVTierMetadata(TransferPlan(1)))
    connector.get_transfer_results(set())
    connector.clear_connector_metadata()
    connector.bind_connector_metadata(KVTierMetadata(TransferPlan(2)))
    connector.get_transfer_results(set())
    meta = connector.build_connector_worker_meta()
    assert meta.report.done == {7: 1, 8: 1}
