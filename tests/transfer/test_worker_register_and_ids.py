"""The worker's inputs and a failed `register()` (SPEC §7).

Regressions: numpy block-id arrays were read by the copy thread after `submit()` had
returned (an engine reusing its id buffer got other blocks copied); a `register()` that
failed after allocating the tiers kept them (pinned memory, the locked disk file); one
bare tensor passed as `kv_tensors` was iterated along its first dimension.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transfer_helpers import FaultyIO, block_bytes, fill_random, job, kv_per_layer, make_worker

from kvtier.offload.plan import Tier, TransferJob, TransferPlan
from kvtier.storage import DiskIOMode
from kvtier.transfer import WorkerConfig
from kvtier.transfer.regions import TensorLayout

pytestmark = pytest.mark.timeout(60)


def test_numpy_block_ids_are_not_read_after_submit_returns(tmp_path: Path) -> None:
    """The ids are copied when `submit()` checks them: changing the caller's array after
    it returned changes nothing."""
    io = FaultyIO()
    io.gate.clear()  # hold the store lane behind a disk write
    kv = kv_per_layer(2, 16)
    fill_random(kv, seed=1)
    config = WorkerConfig(
        cpu_num_slots=4,
        disk_num_slots=4,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
    )
    with make_worker(config, kv, io) as worker:
        src = np.array([3], dtype=np.int64)
        dst = np.array([1], dtype=np.int64)
        first = job(1, Tier.GPU, Tier.DISK, [2], [0])
        second = TransferJob(2, Tier.GPU, Tier.CPU, src, dst)  # type: ignore[arg-type]
        worker.submit(TransferPlan(1, jobs=(first, second)))
        src[0] = 5  # the engine reuses its id buffer for the next step
        io.gate.set()
        worker.flush()
        assert dict(worker.poll().done) == {1: 1, 2: 1}
        slot = b"".join(v[1].numpy().tobytes() for v in worker.host_tier.views)
        assert slot == block_bytes(worker.regions, 3), "slot 1 holds block 5, not block 3"


def test_register_failing_after_the_tiers_were_allocated_releases_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating the CUDA copiers' streams fails after the tiers were allocated and
    pinned: the tiers are released, and the worker is as before (invariants hold)."""
    import torch

    from kvtier.transfer import OffloadWorker
    from kvtier.transfer import host_tier as host_tier_module
    from kvtier.transfer import worker as worker_module
    from kvtier.transfer import worker_resources as worker_resources_module

    pinned: set[int] = set()
    monkeypatch.setattr(host_tier_module, "pin_host_memory", lambda t: pinned.add(t.data_ptr()))
    monkeypatch.setattr(
        host_tier_module, "unpin_host_memory", lambda t: pinned.discard(t.data_ptr())
    )
    monkeypatch.setattr(worker_module, "pin_host_memory", lambda t: pinned.add(t.data_ptr()))
    monkeypatch.setattr(
        worker_resources_module, "unpin_host_memory", lambda t: pinned.discard(t.data_ptr())
    )
    real_discover = worker_module.discover_regions

    def on_fake_gpu(*args: object) -> object:  # the engine's KV cache "lives on cuda:0"
        regions = real_discover(*args)  # type: ignore[arg-type]
        object.__setattr__(regions, "device", torch.device("cuda", 0))
        return regions

    def no_stream(device: object) -> None:
        raise RuntimeError("CUDA error: out of memory (creating a stream)")

    monkeypatch.setattr(worker_module, "discover_regions", on_fake_gpu)
    monkeypatch.setattr(worker_module, "CudaCopier", no_stream)
    config = WorkerConfig(
        cpu_num_slots=4,
        disk_num_slots=4,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
    )
    worker = OffloadWorker(config)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            worker.register(kv_per_layer(2, 8), TensorLayout.KV_FIRST)
        assert not pinned, "register() raised but host memory stays page-locked"
        assert worker.host_tier is None
        assert worker.disk_path is None
        worker.check_invariants()
    finally:
        worker.shutdown()


def test_a_bare_tensor_is_refused_naming_the_fix() -> None:
    """register(packed) instead of register([packed]): every engine block would become a
    "KV tensor" whose blocks are token rows, with no error."""
    import torch

    from kvtier.transfer import OffloadWorker

    packed = torch.zeros(8, 16, 4, 8, dtype=torch.float16)  # [num_blocks, block_size, ...]
    worker = OffloadWorker(WorkerConfig(cpu_num_slots=4))
    try:
        bare = r"one tensor of shape \(8, 16, 4, 8\).*\[that_tensor\]"
        with pytest.raises(TypeError, match=bare):
            worker.register(packed)  # type: ignore[arg-type]
        worker.register([packed])  # the same allocation, as one packed tensor: accepted
        assert worker.num_blocks == 8
    finally:
        worker.shutdown()
