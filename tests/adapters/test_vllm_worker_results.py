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
    return step_bound(connector)


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


def failed_forward(connector: Any, metadata: KVTierMetadata) -> None:
    """Run one step whose forward raises, as Model Runner V1 does (its connector calls
    in a `finally`, the step's output dropped)."""
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv(None)
    try:
        raise RuntimeError("the forward raised")
    except RuntimeError:
        connector.wait_for_save()
        connector.get_transfer_results(set())
        connector.get_block_ids_with_load_errors()
        connector.build_connector_worker_meta()
    connector.clear_connector_metadata()


def test_a_second_failed_forward_makes_plans_built_before_it_unsafe(connector: Any) -> None:
    """The forwards of steps 1 and 2 raise; plan 3 was built once the scheduler role knew
    of step 1's fault only (`fault_step=1`): it may store blocks step 2 never wrote, so
    its store fails, and the metadata names step 2, the newest failed forward (s35 WR4)."""
    failed_forward(connector, KVTierMetadata(TransferPlan(1)))
    failed_forward(connector, KVTierMetadata(TransferPlan(2), fault_step=1))
    store = TransferJob(3, Tier.GPU, Tier.CPU, (12,), (3,))
    *_, meta = step(connector, TransferPlan(3, (store,)), processed_step=2)
    assert meta.failed_forward_step == 2
    assert 3 in meta.report.failed


def test_the_events_of_a_skipped_plan_are_reported_failed_once(connector: Any) -> None:
    """Plan 2 is skipped on this rank (vLLM raised before binding it): its event still
    in flight fails in step 3's report, and only there; reported again, the scheduler
    would count a failure twice (s35 WR10)."""
    step(connector, TransferPlan(1))
    skipped = KVTierMetadata(TransferPlan(3), earlier_events={2: (7,)})
    connector.bind_connector_metadata(skipped)
    *_, meta = step_bound(connector)
    assert meta.report.failed == {7: 1}
    *_, meta = step(connector, TransferPlan(4))
    assert 7 not in meta.report.failed


def step_bound(connector: Any) -> tuple[Any, ...]:
    """Run the rest of a step whose metadata is bound; see `step`."""
    connector.start_load_kv(None)
    connector.wait_for_save()
    results = connector.get_transfer_results(set())
    invalid = connector.get_block_ids_with_load_errors()
    meta = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    return results.finished_recving, results.failed_recving, invalid, meta


def test_a_load_failed_whole_is_reported_to_the_scheduler_without_its_names(
    connector: Any,
) -> None:
    """Loads 1 (r, parts known) and 2 (s, parts unknown) fail, each naming a bad source
    block: r keeps its prefix (GPU block DST[1] invalid), s fails whole, so the scheduler
    must learn event 1's bad block only, or it would fail only the readers of event 2's
    named block while vLLM recomputes all of s (`LoadTracker.unsplit`; s35 WR13, WR14)."""
    split = TransferJob(1, Tier.CPU, Tier.GPU, SLOTS, DST, load_parts=(len(SLOTS),))
    whole = TransferJob(2, Tier.CPU, Tier.GPU, (1, 2), (3, 4))
    plan = TransferPlan(1, (split, whole), {1: ("r",), 2: ("s",)})
    bad = {1: frozenset(SLOTS[1:2]), 2: frozenset({1})}
    fake_reports(connector, WorkerReport(failed={1: 1, 2: 1}, bad_blocks=bad))
    finished, failed, invalid, meta = step(connector, plan)
    assert (finished, failed, invalid) == ({"r", "s"}, {"s"}, {DST[1]})
    assert meta.report.bad_blocks == {1: frozenset(SLOTS[1:2])}


def test_suspect_blocks_sent_again_join_this_step_s_own(connector: Any) -> None:
    """Step 1's output (r's load failed by block, GPU block DST[1] suspect) is dropped;
    in step 2 s's load fails by block too (GPU block 4): vLLM must get both suspects,
    or it would read one that was never loaded (s35 WR24)."""
    fake_reports(
        connector,
        WorkerReport(failed={1: 1}, bad_blocks={1: frozenset(SLOTS[1:2])}),
        WorkerReport(failed={2: 1}, bad_blocks={2: frozenset({2})}),
    )
    step(connector, load_plan(parts=(len(SLOTS),)))
    load = TransferJob(2, Tier.CPU, Tier.GPU, (1, 2), (3, 4), load_parts=(2,))
    plan = TransferPlan(2, (load,), {2: ("s",)})
    finished, failed, invalid, _ = step(connector, plan, processed_step=1)
    assert (finished, failed, invalid) == ({"r", "s"}, set(), {DST[1], 4})


def test_worker_metadata_built_twice_carries_the_step_s_contents_once(connector: Any) -> None:
    """Step 1's output (r's load done) is dropped; step 2 finishes s's load and sends r's
    again. Should the metadata be built a second time before the next poll, it carries
    none of that again (no new output number, no report, no handed request): applied,
    the scheduler would count those events and loads twice (s35 WR29, WR31, WR32)."""
    fake_reports(connector, WorkerReport(done={1: 1}), WorkerReport(done={2: 1}))
    step(connector, load_plan())
    load = TransferJob(2, Tier.CPU, Tier.GPU, (1,), (3,))
    plan = TransferPlan(2, (load,), {2: ("s",)})
    connector.bind_connector_metadata(KVTierMetadata(plan, processed_step=1))
    connector.start_load_kv(None)
    connector.wait_for_save()
    assert connector.get_transfer_results(set()).finished_recving == {"r", "s"}
    me = connector.worker_side.outbox.worker_id
    first = connector.build_connector_worker_meta()
    assert first.report.done == {1: 1, 2: 1}
    assert first.sent == {me: (2, (1, 2))}
    assert first.recving == {me: {"r", "s"}}
    again = connector.build_connector_worker_meta()
    assert again.report.is_empty
    assert again.sent == {me: (2, ())}
    assert not again.recving
    connector.clear_connector_metadata()
