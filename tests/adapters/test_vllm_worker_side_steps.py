"""The worker role's step bookkeeping, driven call by call (mutation run s30).

Each test pins one rule of `WorkerSide` whose fault would report a load or store twice,
lose a failure, or store blocks a failed step never wrote, while vLLM's usual call order
(`vllm_harness`) still passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import kvtier_config, lone_worker
from vllm_harness import VllmHarness

from kvtier.adapters.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport


@pytest.fixture
def worker() -> Iterator[Any]:
    with lone_worker() as worker:
        yield worker


def store(event_id: int) -> TransferJob:
    """Return a store of GPU block 10 + event_id into CPU slot event_id."""
    return TransferJob(event_id, Tier.GPU, Tier.CPU, (10 + event_id,), (event_id,))


def end_step(connector: Any) -> tuple[set[str], set[str], Any]:
    """End the bound step as vLLM does: return its finished and failed loads and its
    worker metadata, then clear the step's metadata."""
    results = connector.get_transfer_results(set())
    meta = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    return results.finished_recving, results.failed_recving, meta


def run_step(connector: Any, metadata: KVTierMetadata) -> tuple[set[str], set[str], Any]:
    """Run one step in Model Runner V2's order, its transfers finished; see `end_step`."""
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.worker_side.worker.flush()
    return end_step(connector)


def test_register_kv_caches_twice_raises_and_keeps_the_first_worker(worker: Any) -> None:
    # A second registration would build a second offload worker over the same KV (the
    # first one's tier and lanes leaked, its in-flight events never reported).
    side = worker.connector.worker_side
    first = side.worker
    with pytest.raises(RuntimeError, match="register_kv_caches called twice"):
        worker.connector.register_kv_caches(worker.cache.tensors)
    assert side.worker is first


def test_a_load_echoed_by_the_last_bound_plan_is_not_echoed_again_after_skipped_plans(
    worker: Any,
) -> None:
    # Plan 1 echoes "r" (a load never issued) and this rank reports it. Plan 2 is skipped
    # here (vLLM raised before binding it); plan 3 carries plan 1's echo in
    # `earlier_echoes` (another rank has not reported it yet): only the skipped plans'
    # echoes are due, so "r" is not reported twice by this rank.
    connector = worker.connector
    finished, failed, _ = run_step(connector, KVTierMetadata(TransferPlan(1), ("r",)))
    assert finished == failed == {"r"}
    skipped = {1: ("r",), 2: ("s",)}
    metadata = KVTierMetadata(TransferPlan(3), earlier_echoes=skipped)
    finished, failed, _ = run_step(connector, metadata)
    assert finished == failed == {"s"}


def test_a_store_submit_that_raised_counts_as_a_failed_forward_of_its_step(
    worker: Any, monkeypatch: Any
) -> None:
    # Under Model Runner V2 a `wait_for_save` that raises ends the step: no result call
    # follows. The next bind counts plan 2's step as failed, so plan 3 (built before the
    # scheduler role learned of it) fails its stores instead of storing blocks whose KV
    # the failed step may have left unwritten. (Plan 1 ran whole first: its taken
    # results say nothing of plan 2's.)
    connector = worker.connector
    run_step(connector, KVTierMetadata(TransferPlan(1)))
    offload = connector.worker_side.worker
    submit = offload.submit

    def refuse_stores(plan: TransferPlan) -> None:
        if any(job.is_store for job in plan.jobs):
            raise MemoryError("refused")
        submit(plan)

    monkeypatch.setattr(offload, "submit", refuse_stores)
    connector.bind_connector_metadata(KVTierMetadata(TransferPlan(2, (store(2),))))
    connector.start_load_kv(None)
    with pytest.raises(MemoryError):
        connector.wait_for_save()
    monkeypatch.setattr(offload, "submit", submit)
    _, _, meta = run_step(connector, KVTierMetadata(TransferPlan(3, (store(3),))))
    assert isinstance(meta, KVTierWorkerMetadata)
    assert meta.failed_forward_step == 2
    assert set(meta.report.failed) == {2, 3}
    assert not meta.report.done


def test_a_skipped_plan_fails_its_own_step_not_the_plan_bound_after_it(worker: Any) -> None:
    # Plan 2 is skipped here; plan 3 was built once the scheduler role knew of a fault
    # at step 2 (`fault_step=2`): its stores are safe and run. Noting plan 3's own step
    # as failed would fail them, and report a fault at a step whose forward ran.
    connector = worker.connector
    run_step(connector, KVTierMetadata(TransferPlan(1)))
    _, _, meta = run_step(connector, KVTierMetadata(TransferPlan(3, (store(3),)), fault_step=2))
    assert isinstance(meta, KVTierWorkerMetadata)
    assert meta.failed_forward_step is None
    assert set(meta.report.done) == {3}
    assert not meta.report.failed


def load_plan(step_id: int, event_id: int, request_id: str) -> TransferPlan:
    """Return a plan loading CPU slot 5 into GPU block 9 for `request_id`, and a store."""
    load = TransferJob(event_id, Tier.CPU, Tier.GPU, (5,), (9,))
    return TransferPlan(step_id, (load, store(event_id + 1)), {event_id: (request_id,)})


def test_a_forward_that_raised_after_its_loads_started_fails_only_its_stores(
    worker: Any,
) -> None:
    # Model Runner V2: `start_load_kv` ran before the forward, which raised; nothing else
    # was called. The next bind fails the stores never submitted, but the load runs on:
    # failing it too would release its request's GPU blocks to vLLM while the copy into
    # them still runs, and report the event twice.
    connector = worker.connector
    connector.bind_connector_metadata(KVTierMetadata(load_plan(1, 1, "r")))
    connector.start_load_kv(None)
    outstanding = TransferPlan(2, load_request_ids={1: ("r",)})  # the load, in flight
    finished, failed, meta = run_step(connector, KVTierMetadata(outstanding))
    assert (finished, failed) == ({"r"}, set())
    assert isinstance(meta, KVTierWorkerMetadata)
    assert set(meta.report.done) == {1}
    assert set(meta.report.failed) == {2}


def test_wait_for_save_submits_the_loads_start_load_kv_never_did(worker: Any) -> None:
    connector = worker.connector
    connector.bind_connector_metadata(KVTierMetadata(load_plan(1, 1, "r")))
    connector.wait_for_save()
    connector.worker_side.worker.flush()
    finished, failed, meta = end_step(connector)
    assert (finished, failed) == ({"r"}, set())
    assert isinstance(meta, KVTierWorkerMetadata)
    assert set(meta.report.done) == {1, 2}


def test_a_refused_plans_event_the_worker_already_failed_is_reported_once(
    worker: Any, monkeypatch: Any
) -> None:
    # The submit raised after the worker took the plan's first load, which failed at once
    # (`peek`: reported, not yet polled): only the event it never took is failed here.
    # Failing the taken one as well would count this rank's failure of it twice.
    connector = worker.connector
    offload = connector.worker_side.worker
    failed_first = WorkerReport(failed={1: 1})
    polls = [failed_first]

    def refuse(plan: TransferPlan) -> None:  # event 1 taken (and failed: `peek`, `poll`)
        raise OSError("injected: raised after the worker took event 1")

    monkeypatch.setattr(offload, "submit", refuse)
    monkeypatch.setattr(offload, "flush", lambda: None)
    monkeypatch.setattr(offload, "peek", lambda: failed_first)
    monkeypatch.setattr(offload, "poll", lambda: polls.pop() if polls else WorkerReport())
    loads = tuple(TransferJob(e, Tier.CPU, Tier.GPU, (e,), (e,)) for e in (1, 2))
    plan = TransferPlan(1, loads, {1: ("r",), 2: ("s",)})
    connector.bind_connector_metadata(KVTierMetadata(plan))
    with pytest.raises(OSError, match="injected"):
        connector.start_load_kv(None)
    _, failed, meta = end_step(connector)
    assert failed == {"r", "s"}
    assert isinstance(meta, KVTierWorkerMetadata)
    assert meta.report.failed == {1: 1, 2: 1}


def test_a_refused_plan_whose_flush_fails_raises_the_submits_error_and_fails_nothing(
    worker: Any, monkeypatch: Any
) -> None:
    # A copy may still write the GPU blocks: nothing is failed, and vLLM sees the
    # submit's error, not the flush's.
    connector = worker.connector
    offload = connector.worker_side.worker

    def refuse(plan: TransferPlan) -> None:
        raise OSError("injected: submit")

    def broken_flush() -> None:
        raise RuntimeError("injected: flush")

    monkeypatch.setattr(offload, "submit", refuse)
    monkeypatch.setattr(offload, "flush", broken_flush)
    connector.bind_connector_metadata(KVTierMetadata(load_plan(1, 1, "r")))
    with pytest.raises(OSError, match="injected: submit"):
        connector.start_load_kv(None)
    monkeypatch.undo()
    _, failed, meta = end_step(connector)
    assert failed == set()
    assert isinstance(meta, KVTierWorkerMetadata)
    assert set(meta.report.failed) == {2}  # the store: never handed to the worker


def test_a_worker_that_never_started_removes_its_disk_folder_once(tmp_path: Path) -> None:
    # Its start failed (the folder it made removed), then vLLM shuts it down: a folder
    # made again in between (another engine starting on that `disk_path`) stays.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    folder = tmp_path / "tier"
    extra = {"cpu_bytes": 0, "disk_bytes": 1 << 22, "disk_path": str(folder)}
    harness = VllmHarness(kvtier_config(extra={**extra, "disk_io_mode": "page_cache"}))
    try:
        connector = KVConnectorFactory.create_connector(
            harness.vllm_config, KVConnectorRole.WORKER, harness.kv_cache_config
        )
        with pytest.raises(ValueError, match="no KV tensors"):
            connector.register_kv_caches({})
        assert not folder.exists()
        folder.mkdir()
        connector.shutdown()
        assert folder.is_dir()
    finally:
        harness.close()


def test_a_plan_refused_by_an_interrupt_fails_its_events(worker: Any, monkeypatch: Any) -> None:
    # KeyboardInterrupt is no Exception: caught only as BaseException. Unfailed, the
    # load's request would wait for it for good once vLLM resumes.
    connector = worker.connector
    offload = connector.worker_side.worker

    def interrupted(plan: TransferPlan) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(offload, "submit", interrupted)
    connector.bind_connector_metadata(KVTierMetadata(load_plan(1, 1, "r")))
    with pytest.raises(KeyboardInterrupt):
        connector.start_load_kv(None)
    monkeypatch.undo()
    results = connector.get_transfer_results(set())
    assert results.failed_recving == {"r"}
    connector.clear_connector_metadata()


def test_get_finished_refuses_to_report_a_load_that_failed_whole_or_by_block(
    worker: Any, monkeypatch: Any
) -> None:
    # The older API cannot say a load failed: reporting it finished would serve its
    # GPU blocks as loaded.
    connector = worker.connector
    side = connector.worker_side
    outcomes = [
        (({"r"}, {"r"}), set()),  # failed whole
        (({"r"}, set()), {3}),  # finished, block 3 not loaded
        (({"r"}, set()), set()),
    ]

    def take(results: Any, invalid: set[int]) -> None:
        monkeypatch.setattr(side, "take_results", lambda: results)
        monkeypatch.setattr(side, "take_invalid_blocks", lambda: invalid)

    for results, invalid in outcomes[:2]:
        take(results, invalid)
        with pytest.raises(RuntimeError, match="get_finished"):
            connector.get_finished(set())
    take(*outcomes[2])
    assert connector.get_finished(set()) == (None, {"r"})


def test_another_connectors_metadata_is_refused_by_name(worker: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    with pytest.raises(TypeError, match="expected KVTierMetadata, got KVConnectorMetadata"):
        worker.connector.bind_connector_metadata(KVConnectorMetadata())
    with pytest.raises(TypeError, match="expected KVTierMetadata"):
        worker.connector.handle_preemptions(KVConnectorMetadata())


def test_stores_of_a_forward_that_raised_fail_though_wait_for_save_comes_first(
    worker: Any,
) -> None:
    # Model Runner V1 calls `wait_for_save` first in the `finally` around a forward that
    # raised: plan 1's store may read a block the forward never wrote (or another
    # request's local hit the step computes), so it fails, and the step counts as a
    # failed forward (s35 WS20).
    connector = worker.connector
    connector.bind_connector_metadata(KVTierMetadata(TransferPlan(1, (store(1),))))
    connector.start_load_kv(None)
    try:
        raise RuntimeError("the forward raised")
    except RuntimeError:
        connector.wait_for_save()
        end_step(connector)
    _, _, meta = run_step(connector, KVTierMetadata(TransferPlan(2)))
    assert isinstance(meta, KVTierWorkerMetadata)
    assert meta.failed_forward_step == 1
    assert meta.report.failed == {1: 1}
    assert not meta.report.done


def test_a_plan_s_slot_drops_are_submitted_without_any_load(worker: Any, monkeypatch: Any) -> None:
    # `forget_slots` and `end_persistence` go with the loads' submit even when the plan
    # has neither loads nor demotions: kept back, the worker would keep those slots
    # (s35 WS17).
    offload = worker.connector.worker_side.worker
    submitted: list[TransferPlan] = []
    monkeypatch.setattr(offload, "submit", submitted.append)
    plan = TransferPlan(1, forget_slots=(3,))
    run_step(worker.connector, KVTierMetadata(plan))
    assert [p.forget_slots for p in submitted] == [(3,)]


def test_a_plan_that_needs_a_flush_finishes_every_transfer_first(
    worker: Any, monkeypatch: Any
) -> None:
    # A preempted request's GPU blocks may be reused at once: every copy in flight ends
    # before the step (s35 WS28).
    offload = worker.connector.worker_side.worker
    flushes: list[None] = []
    monkeypatch.setattr(offload, "flush", lambda: flushes.append(None))
    worker.connector.handle_preemptions(KVTierMetadata(TransferPlan(1, need_flush=True)))
    assert flushes == [None]
    worker.connector.handle_preemptions(KVTierMetadata(TransferPlan(2)))
    assert flushes == [None]
