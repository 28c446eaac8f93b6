"""The worker role marks the compute a load must wait for before vLLM launches the forward.

vLLM 0.33 starts asynchronous loads right after launching the step's forward pass, and
with asynchronous scheduling (its default) a load's destination blocks may still be
written by their previous owner's last forward. The load must wait for the compute queued
before this step's forward, not for the forward itself: the compute-done mark is taken at
`bind_connector_metadata`, and the store mark again at `wait_for_save`.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import kvtier_config
from vllm_harness import ConnectorWorker, FakeKVCache, VllmHarness

from kvtier.adapters.vllm.metadata import KVTierMetadata
from kvtier.offload.plan import Tier, TransferJob, TransferPlan


def test_loads_wait_for_a_mark_taken_before_the_forward_and_stores_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    harness = VllmHarness(kvtier_config(extra={"num_blocks": 16}))
    worker = ConnectorWorker.create(
        harness.vllm_config, harness.kv_cache_config, FakeKVCache(harness.kv_cache_config)
    )
    connector = worker.connector
    offload = connector.worker_side.worker
    log: list[str] = []
    record, submit = offload.record_compute_done, offload.submit

    def recording_mark() -> None:
        log.append("mark")
        record()

    def recording_submit(plan: TransferPlan) -> None:
        log.append("+".join(f"{job.src_tier.value}>{job.dst_tier.value}" for job in plan.jobs))
        submit(plan)

    monkeypatch.setattr(offload, "record_compute_done", recording_mark)
    monkeypatch.setattr(offload, "submit", recording_submit)

    def step(*jobs: TransferJob, **plan: Any) -> None:
        """One step in vLLM's order, asynchronous loads started after the forward launch."""
        metadata = KVTierMetadata(TransferPlan(1, jobs, **plan))
        connector.handle_preemptions(metadata)
        connector.bind_connector_metadata(metadata)
        log.append("forward")
        connector.start_load_kv(None)  # type: ignore[arg-type]
        connector.wait_for_save()
        offload.flush()
        connector.get_transfer_results(set())
        connector.build_connector_worker_meta()
        connector.clear_connector_metadata()

    step(TransferJob(1, Tier.GPU, Tier.CPU, (1, 2), (3, 4)))
    assert log == ["forward", "mark", "GPU>CPU"]
    log.clear()
    step(
        TransferJob(2, Tier.CPU, Tier.GPU, (3, 4), (5, 6)),
        TransferJob(3, Tier.GPU, Tier.CPU, (7,), (8,)),
        load_request_ids={2: ("r",)},
    )
    assert log == ["mark", "forward", "CPU>GPU", "mark", "GPU>CPU"]
    connector.shutdown()
