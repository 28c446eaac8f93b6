"""GPU path of the worker: pinned host tier, stream ordering, round trips (need CUDA).

Copy bandwidth is measured by `benchmarks/bench_transfer.py --device cuda`, not here:
no timing assertion goes into the test suite. `scripts/gpu_check.sh` runs both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transfer_helpers import block_bytes, fill_random, job, kv_per_layer, make_worker, run_plan

from kvtier.offload.plan import Tier
from kvtier.storage import DiskIOMode
from kvtier.transfer import OffloadWorker, WorkerConfig
from kvtier.transfer.copiers import CudaCopier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


def test_host_tier_is_pinned_in_place_at_exactly_the_budget(tmp_path: Path) -> None:
    """Host tier and disk staging buffers are page-locked without a rounding allocator;
    shutdown unpins them."""
    kv = kv_per_layer(4, 64, (16, 8, 128), device="cuda")  # 32 KiB per K or V block
    cfg = WorkerConfig(cpu_num_slots=100, disk_num_slots=8, disk_path=str(tmp_path))
    worker = make_worker(cfg, kv)
    host = worker.host_tier
    assert host is not None
    assert host.is_pinned
    for view in host.views:
        assert view.is_pinned()
        assert view.untyped_storage().nbytes() == 100 * view.shape[1]
    assert sum(v.shape[1] for v in host.views) == worker.bytes_per_slot == 8 * 32768
    worker.shutdown()
    assert not host.is_pinned
    assert not any(view.is_pinned() for view in host.views)


@pytest.mark.parametrize("mode", [DiskIOMode.DIRECT, DiskIOMode.PAGE_CACHE])
def test_gpu_round_trips_through_host_and_disk(tmp_path: Path, mode: DiskIOMode) -> None:
    """GPU → CPU → GPU and GPU → DISK → GPU land the exact bytes in other GPU blocks."""
    kv = kv_per_layer(4, 96, (16, 8, 128), device="cuda")
    fill_random(kv, seed=1)
    cfg = WorkerConfig(
        cpu_num_slots=64,
        disk_num_slots=64,
        disk_path=str(tmp_path),
        disk_io_mode=mode,
        disk_batch_bytes=1 << 20,
    )
    with make_worker(cfg, kv) as worker:
        blocks, slots = list(range(1, 41, 2)), [63, *range(0, 38, 2)]
        images = [block_bytes(worker.regions, b) for b in blocks]
        report = run_plan(
            worker,
            job(1, Tier.GPU, Tier.CPU, blocks, slots),
            job(2, Tier.GPU, Tier.DISK, blocks, slots),
        )
        assert dict(report.done) == {1: 1, 2: 1}
        fill_random(kv, seed=2)
        # Loads do not wait for compute: the engine hands a load only blocks no queued
        # kernel writes, so the overwrite above must finish before the loads start.
        torch.cuda.synchronize()
        report = run_plan(
            worker,
            job(3, Tier.CPU, Tier.GPU, slots, list(range(50, 70))),
            job(4, Tier.DISK, Tier.GPU, slots, list(range(70, 90))),
        )
        assert dict(report.done) == {3: 1, 4: 1}
        assert [block_bytes(worker.regions, b) for b in range(50, 70)] == images
        assert [block_bytes(worker.regions, b) for b in range(70, 90)] == images


def race_store_against_forward(
    worker: OffloadWorker, kv: list[torch.Tensor], iterations: int, explicit_marker: bool
) -> int:
    """Per iteration: launch a long "forward" that ends by writing block 1, submit a store
    of block 1 at once, then load the slot back; return how many loads saw stale bytes."""
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    corruptions = 0
    for i in range(iterations):
        value = float(i % 1000 + 1)
        out = busy
        for _ in range(4):
            out = out @ busy  # ~ms of compute ahead of the KV write
        for tensor in kv:
            tensor[:, 1].fill_(value)
        if explicit_marker:
            worker.record_compute_done()
        run_plan(worker, job(10 * i + 1, Tier.GPU, Tier.CPU, [1], [i % 4]))
        run_plan(worker, job(10 * i + 2, Tier.CPU, Tier.GPU, [i % 4], [2]))
        if not all(bool((t[:, 2] == value).all()) for t in kv):
            corruptions += 1
    return corruptions


@pytest.mark.parametrize("explicit_marker", [False, True])
def test_store_waits_for_the_forward_write(explicit_marker: bool) -> None:
    """SPEC scenario 30: a store racing a forward write sees the written bytes every time
    (0 corruptions over 100 iterations) because its stream waits for compute-done."""
    kv = kv_per_layer(2, 8, (16, 8, 128), device="cuda")
    with make_worker(WorkerConfig(cpu_num_slots=4), kv) as worker:
        assert race_store_against_forward(worker, kv, 100, explicit_marker) == 0


def test_without_the_compute_wait_the_race_is_real(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEC scenario 30, control: with the wait disabled the same race corrupts stores,
    so the test above can fail."""
    monkeypatch.setattr(CudaCopier, "wait_for_compute", lambda self, marker: None)
    kv = kv_per_layer(2, 8, (16, 8, 128), device="cuda")
    with make_worker(WorkerConfig(cpu_num_slots=4), kv) as worker:
        assert race_store_against_forward(worker, kv, 20, explicit_marker=False) > 0
