"""Byte-exact store → evict → load through the connector's worker role (CPU tensors).

The worker role is built by vLLM's connector factory over the harness's fake KV cache,
which is laid out exactly as vLLM's planner placed it; every byte of every layer's page
must come back, and no byte outside the destination blocks may change.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch
from kvtier_vllm import SLOT_BYTES, PollGate, kvtier_config
from vllm_harness import ConnectorWorker, FakeKVCache, VllmHarness

from kvtier.adapters.vllm.metadata import KVTierMetadata
from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport
from kvtier.transfer.worker import OffloadWorker

SRC = (1, 2, 3, 7)
SLOTS = (5, 6, 7, 8)
DST = (9, 10, 11, 14)


def run_step(worker: ConnectorWorker, plan: TransferPlan) -> tuple[set[str], dict[int, int]]:
    """Drive one step of the worker role in vLLM's order; return finished loads, done events."""
    connector = worker.connector
    metadata = KVTierMetadata(plan)
    connector.handle_preemptions(metadata)
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv(None)  # type: ignore[arg-type]
    connector.wait_for_save()
    results = connector.get_transfer_results(set())
    meta = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    assert not results.failed_recving
    return results.finished_recving, dict(meta.report.done) if meta else {}


def until_done(worker: ConnectorWorker, plan: TransferPlan, event_id: int) -> set[str]:
    """Step (the first step carries `plan`) until `event_id` is reported done."""
    finished: set[str] = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        step_finished, done = run_step(worker, plan)
        finished |= step_finished
        if event_id in done:
            return finished
        plan = TransferPlan(step_id=plan.step_id + 1, load_request_ids=plan.load_request_ids)
        time.sleep(0.001)
    raise AssertionError(f"event {event_id} never finished")


def page_bytes(cache: FakeKVCache, blocks: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {
        name: tensor[list(blocks)].contiguous().view(torch.uint8).clone()
        for name, tensor in cache.tensors.items()
    }


@pytest.mark.parametrize("kv_cache_layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_store_evict_load_round_trip_is_byte_exact(
    kv_cache_layout: str, tier: str, tmp_path: Path
) -> None:
    extra: dict[str, object] = {"num_blocks": 16}
    if tier == "disk":
        extra.update(
            cpu_bytes=0,
            disk_bytes=16 * SLOT_BYTES,
            disk_path=str(tmp_path),
            disk_io_mode="page_cache",
        )
    harness = VllmHarness(kvtier_config(kv_cache_layout=kv_cache_layout, extra=extra))
    cache = FakeKVCache(harness.kv_cache_config)
    worker = ConnectorWorker.create(harness.vllm_config, harness.kv_cache_config, cache)
    gen = torch.Generator().manual_seed(1)
    cache.raw.copy_(torch.randint(-128, 128, cache.raw.shape, dtype=torch.int8, generator=gen))
    original = page_bytes(cache, SRC)
    tier_enum = Tier.CPU if tier == "cpu" else Tier.DISK

    store = TransferJob(1, Tier.GPU, tier_enum, SRC, SLOTS)
    until_done(worker, TransferPlan(step_id=1, jobs=(store,)), event_id=1)

    # Evict: the engine reuses every GPU block for other data.
    cache.raw.copy_(torch.randint(-128, 128, cache.raw.shape, dtype=torch.int8, generator=gen))
    before_load = cache.raw.clone()
    load = TransferJob(2, tier_enum, Tier.GPU, SLOTS, DST)
    plan = TransferPlan(step_id=10, jobs=(load,), load_request_ids={2: ("r",)})
    assert until_done(worker, plan, event_id=2) == {"r"}

    loaded = page_bytes(cache, DST)
    for name in cache.tensors:
        assert torch.equal(loaded[name], original[name]), f"layer {name} changed in transit"
    untouched = [b for b in range(harness.kv_cache_config.num_blocks) if b not in DST]
    for tensor, before in zip(cache.tensors.values(), _views(cache, before_load), strict=True):
        now, then = tensor[untouched].view(torch.int16), before[untouched].view(torch.int16)
        assert torch.equal(now, then), "bytes outside DST changed"  # bits: NaNs are data
    worker.connector.shutdown()


@pytest.mark.parametrize("mode", ["write_through", "write_back"])
def test_cascade_load_split_over_cpu_and_disk_is_byte_exact(mode: str, tmp_path: Path) -> None:
    extra = {
        "disk_bytes": 32 * SLOT_BYTES,
        "disk_path": str(tmp_path),
        "disk_io_mode": "page_cache",
        "cascade": mode,
    }
    harness = VllmHarness(kvtier_config(num_cpu_blocks=16, extra=extra))
    cache = FakeKVCache(harness.kv_cache_config)
    worker = ConnectorWorker.create(harness.vllm_config, harness.kv_cache_config, cache)
    offload = worker.connector.worker_side.worker
    assert (offload.config.cpu_num_slots, offload.config.disk_num_slots) == (16, 32)
    gen = torch.Generator().manual_seed(2)

    def scramble() -> None:
        cache.raw.copy_(torch.randint(-128, 128, cache.raw.shape, dtype=torch.int8, generator=gen))

    scramble()
    original = page_bytes(cache, SRC)
    disk_slots = (20, 3)
    until_done(worker, TransferPlan(1, (TransferJob(1, Tier.GPU, Tier.CPU, SRC, SLOTS),)), 1)
    demote = TransferJob(2, Tier.CPU, Tier.DISK, SLOTS[2:], disk_slots)  # neither load nor store
    until_done(worker, TransferPlan(2, (demote,)), 2)
    scramble()  # evicted from the GPU; the CPU slots of the demoted half get other data
    until_done(
        worker, TransferPlan(3, (TransferJob(3, Tier.GPU, Tier.CPU, SRC[2:], SLOTS[2:]),)), 3
    )

    scramble()
    before_load = cache.raw.clone()
    held = HoldEvent(offload, event_id=5, polls=2)  # the disk half is reported last
    loads = (
        TransferJob(4, Tier.CPU, Tier.GPU, SLOTS[:2], DST[:2]),
        TransferJob(5, Tier.DISK, Tier.GPU, disk_slots, DST[2:]),
    )
    plan = TransferPlan(4, loads, load_request_ids={4: ("r",), 5: ("r",)})
    finished_at: dict[str, int] = {}
    done_at: dict[int, int] = {}
    for step in range(10_000):
        finished, done = run_step(worker, plan)
        finished_at.update(dict.fromkeys(finished, step))
        done_at.update({event_id: step for event_id in done if event_id not in done_at})
        if len(done_at) == 2 and "r" in finished_at:
            break
        plan = TransferPlan(plan.step_id + 1, load_request_ids=plan.load_request_ids)
        time.sleep(0.001)
    assert held.num_held > 0
    assert done_at[4] < done_at[5] == finished_at["r"], "r finished before both halves landed"

    loaded = page_bytes(cache, DST)
    for name in cache.tensors:
        assert torch.equal(loaded[name], original[name]), f"layer {name} changed in transit"
    untouched = [b for b in range(harness.kv_cache_config.num_blocks) if b not in DST]
    for tensor, before in zip(cache.tensors.values(), _views(cache, before_load), strict=True):
        now, then = tensor[untouched].view(torch.int16), before[untouched].view(torch.int16)
        assert torch.equal(now, then), "bytes outside DST changed"
    assert worker.connector.worker_side.loads.is_idle()
    worker.connector.shutdown()


class HoldEvent:
    """Report one event `polls` polls later than the worker finished it."""

    def __init__(self, worker: OffloadWorker, event_id: int, polls: int) -> None:
        self._poll = worker.poll
        self._event_id = event_id
        self._polls = polls
        self._held: WorkerReport | None = None
        self.num_held = 0
        worker.poll = self.poll  # type: ignore[method-assign]

    def poll(self) -> WorkerReport:
        report = self._poll()
        if self._event_id in report.done or self._event_id in report.failed:
            self._held = WorkerReport(
                {k: v for k, v in report.done.items() if k == self._event_id},
                {k: v for k, v in report.failed.items() if k == self._event_id},
            )
            report = WorkerReport(
                {k: v for k, v in report.done.items() if k != self._event_id},
                {k: v for k, v in report.failed.items() if k != self._event_id},
            )
        if self._held is not None:
            if self._polls == 0:
                report, self._held = WorkerReport.merge([report, self._held]), None
            else:
                self._polls -= 1
                self.num_held += 1
        return report


def _views(cache: FakeKVCache, raw: torch.Tensor) -> list[torch.Tensor]:
    """Return the per-layer views `cache` has, over another copy of its bytes."""
    offset = cache.raw.data_ptr()
    views = []
    for tensor in cache.tensors.values():
        start = (tensor.data_ptr() - offset) // tensor.element_size()
        views.append(raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), start))
    return views


def test_get_finished_refuses_to_report_a_failed_load_as_finished() -> None:
    harness = VllmHarness(kvtier_config(extra={"num_blocks": 16}))
    worker = ConnectorWorker.create(
        harness.vllm_config, harness.kv_cache_config, FakeKVCache(harness.kv_cache_config)
    )
    PollGate(worker.connector.worker_side.worker).fail_loads(lambda block_ids: None)
    load = TransferJob(1, Tier.CPU, Tier.GPU, SLOTS, DST)
    metadata = KVTierMetadata(TransferPlan(step_id=1, jobs=(load,), load_request_ids={1: ("r",)}))
    connector = worker.connector
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv(None)  # type: ignore[arg-type]
    connector.wait_for_save()
    connector.worker_side.worker.flush()
    with pytest.raises(RuntimeError, match=r"failed for \['r'\]"):
        connector.get_finished(set())
    connector.shutdown()


def test_get_finished_refuses_to_report_a_load_failed_by_block_as_finished() -> None:
    """The worker names a bad block of the load (one full-attention group): the request
    is finished with a load error, which this API cannot carry."""
    harness = VllmHarness(kvtier_config(extra={"num_blocks": 16}))
    worker = ConnectorWorker.create(
        harness.vllm_config, harness.kv_cache_config, FakeKVCache(harness.kv_cache_config)
    )
    offload = worker.connector.worker_side.worker
    load = TransferJob(1, Tier.CPU, Tier.GPU, SLOTS, DST, load_parts=(len(SLOTS),))
    metadata = KVTierMetadata(TransferPlan(step_id=1, jobs=(load,), load_request_ids={1: ("r",)}))
    connector = worker.connector
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv(None)  # type: ignore[arg-type]
    connector.wait_for_save()
    offload.flush()
    offload.poll()  # the copy's own report, replaced by one naming a bad block
    offload.poll = lambda: WorkerReport(failed={1: 1}, bad_blocks={1: frozenset(SLOTS[1:2])})
    with pytest.raises(RuntimeError, match=rf"failed for \[\] \(GPU blocks \[{DST[1]}\]"):
        connector.get_finished(set())
    connector.shutdown()
