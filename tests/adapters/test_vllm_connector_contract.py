"""`KVTierConnector` duties vLLM's flow alone does not show on CPU tensors.

Each test pins one call's contract that, if broken, would serve wrong KV or leak
blocks on a real engine while the CPU harness still passes (copies there finish at once).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, kvtier_harness, offload_worker, scheduler_side
from test_vllm_connector import run_waves
from vllm_harness import ConnectorWorker, shared_prefix_prompts

from kvtier.adapters.vllm.metadata import KVTierMetadata
from kvtier.adapters.vllm.scheduler_side import _handoffs
from kvtier.offload.config import DiskIOMode
from kvtier.offload.protocols import Handoff, StepInput


def test_a_preemption_flushes_every_transfer_before_the_forward() -> None:
    # A preempted request's GPU blocks may be reused by this step's forward, so every
    # copy still reading or writing them must finish in `handle_preemptions`.
    harness = kvtier_harness(num_gpu_blocks=30, max_num_seqs=8)
    worker = offload_worker(harness)
    flush = worker.flush
    calls: list[str] = []

    def counted_flush() -> None:
        calls.append("flush")
        flush()

    worker.flush = counted_flush  # type: ignore[method-assign]
    rank = harness.workers[0]
    assert isinstance(rank, ConnectorWorker)
    handle = rank.connector.handle_preemptions
    flushed: list[bool] = []

    def checked(metadata: Any) -> None:
        assert isinstance(metadata, KVTierMetadata)
        calls.clear()
        handle(metadata)
        if metadata.plan.need_flush:
            flushed.append(calls == ["flush"])

    rank.connector.handle_preemptions = checked  # type: ignore[method-assign]
    prompts = shared_prefix_prompts(16, prefix_len=64, suffix_len=24, num_prefixes=4)
    assert run_waves(harness, prompts, wave=8, max_tokens=48) > 0
    assert flushed, "no step asked for a flush"
    assert all(flushed), "a preemption step did not flush before its forward"
    check_quiescent(harness)


def test_the_single_group_finish_path_stores_and_never_delays_the_free() -> None:
    # `MultiConnector` with a child lacking HMA finishes requests through
    # `request_finished` (one group): kvtier must still store, and free at once.
    harness = kvtier_harness()
    connector = harness.scheduler.connector
    assert connector is not None
    results: list[tuple[bool, Any]] = []

    def one_group(request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        results.append(connector.request_finished(request, block_ids[0]))
        return results[-1]

    connector.request_finished_all_groups = one_group  # type: ignore[method-assign]
    prompts = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
    harness.run_requests(prompts, max_tokens=3)
    assert len(results) == len(prompts)
    assert all(result == (False, None) for result in results)
    tier = scheduler_side(harness).offload.tier_pool
    assert sum(tier.is_cached(b) for b in range(1, tier.num_blocks)) == 4 * 3
    assert harness.scheduler.reset_prefix_cache()
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=3)
    assert all(harness.external_hit_tokens(r) == 48 for r in again)
    check_quiescent(harness)


def test_eager_stores_of_a_new_request_start_while_it_runs() -> None:
    # vLLM gives a new request's whole block table (`is_full_table`): kvtier must track
    # it from that step, not only flush the request when it finishes.
    harness = kvtier_harness()
    prompt = shared_prefix_prompts(1, prefix_len=64, suffix_len=8)["req-0"]
    harness.add_request("a", prompt, max_tokens=40)
    for _ in range(3):
        harness.step()
    offload_worker(harness).flush()  # the copies land; the next step reports them
    for _ in range(2):
        harness.step()
    assert "a" not in harness.finished
    tier = scheduler_side(harness).offload.tier_pool
    assert sum(tier.is_cached(b) for b in range(1, tier.num_blocks)) == 4
    harness.run()
    check_quiescent(harness)


def test_the_worker_role_opens_its_disk_tier_as_configured(tmp_path: Path) -> None:
    # Direct I/O is the default; page_cache (e.g. a file system without O_DIRECT) and
    # the buffer size must reach each rank's worker, not only the scheduler role.
    extra = {
        "cpu_bytes": 0,
        "disk_bytes": 1 << 22,
        "disk_path": str(tmp_path),
        "disk_io_mode": "page_cache",
        "disk_buffer_slots": 3,
    }
    config = offload_worker(kvtier_harness(extra=extra)).config
    assert config.disk_io_mode is DiskIOMode.PAGE_CACHE
    assert config.disk_buffer_slots == 3
    assert config.disk_path == str(tmp_path)


@pytest.mark.parametrize("register", [True, False])
def test_a_worker_that_never_starts_removes_the_disk_folder_it_made(
    tmp_path: Path, register: bool
) -> None:
    """Regression: the worker role's `prepare_host` made `disk_path` and nothing removed
    it when `register_kv_caches` failed, or vLLM failed before calling it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    folder = tmp_path / "tier"
    extra = {"cpu_bytes": 0, "disk_bytes": 1 << 22, "disk_path": str(folder)}
    harness = kvtier_harness(extra={**extra, "disk_io_mode": "page_cache"})
    try:
        shutil.rmtree(folder)  # made by the harness's own worker roles
        connector = KVConnectorFactory.create_connector(
            harness.vllm_config, KVConnectorRole.WORKER, harness.kv_cache_config
        )
        assert folder.is_dir()
        if register:
            with pytest.raises(ValueError, match="no KV tensors"):
                connector.register_kv_caches({})
            assert not folder.exists()
        connector.shutdown()
        assert not folder.exists()
    finally:
        harness.close()


def test_finished_and_preempted_ids_reach_the_offload_scheduler() -> None:
    # A lazy store takes hand-offs of untracked requests: only these sets keep it from
    # reading blocks that a request finished or preempted this step gave up.
    harness = kvtier_harness(num_gpu_blocks=30, max_num_seqs=8, extra={"store_mode": "lazy"})
    side = scheduler_side(harness)
    build_plan, build_metadata = side.offload.build_plan, side.build_metadata
    steps: list[StepInput] = []
    seen = {"finished": 0, "preempted": 0}

    def capture(step: StepInput) -> Any:
        steps.append(step)
        return build_plan(step)

    def checked(scheduler_output: Any) -> KVTierMetadata:
        metadata = build_metadata(scheduler_output)
        step = steps[-1]
        assert step.finished_request_ids == scheduler_output.finished_req_ids
        assert step.preempted_request_ids == set(scheduler_output.preempted_req_ids or ())
        seen["finished"] += len(step.finished_request_ids)
        seen["preempted"] += len(step.preempted_request_ids)
        return metadata

    side.offload.build_plan = capture  # type: ignore[method-assign]
    side.build_metadata = checked  # type: ignore[method-assign]
    prompts = shared_prefix_prompts(16, prefix_len=64, suffix_len=24, num_prefixes=4)
    run_waves(harness, prompts, wave=8, max_tokens=48)
    assert seen["finished"] == len(prompts)
    assert seen["preempted"] > 0


def test_boundary_state_hand_offs_become_kvtier_hand_offs() -> None:
    offers = {"a": [(1, 7, 64), (2, 9, 64)], "b": [(1, 3, 128)]}
    output = SimpleNamespace(
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers)
    )
    assert _handoffs(output) == (Handoff("a", 1, 7), Handoff("a", 2, 9), Handoff("b", 1, 3))
    assert _handoffs(SimpleNamespace(kv_connector_block_state=None)) == ()
