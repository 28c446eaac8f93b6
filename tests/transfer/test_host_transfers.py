"""Host tier round trips through the worker, byte for byte (SPEC §7 host tier, copies)."""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import (
    block_bytes,
    fill_random,
    job,
    kv_per_layer,
    make_worker,
    run_plan,
)

import kvtier.transfer.copy_crew as copy_crew
from kvtier.offload.plan import Tier
from kvtier.transfer import WorkerConfig
from kvtier.transfer.regions import TensorLayout


def layouts() -> dict[str, list[torch.Tensor]]:
    """Engine caches in every supported shape, 32 blocks each."""
    packed = torch.zeros(32, 3, 2, 4, 8, dtype=torch.float16)
    return {
        "kv_first": kv_per_layer(3, 32, (4, 2, 8)),
        "blocks_first": [torch.zeros(32, 2, 4, 2, 8, dtype=torch.float16) for _ in range(2)],
        "k_v_separate": [torch.zeros(32, 4, 2, 8, dtype=torch.float32) for _ in range(4)],
        "packed": [packed[:, i] for i in range(3)],
        "mixed_widths": [
            torch.zeros(32, 4, 24, dtype=torch.float16),
            torch.zeros(32, 3, 5, dtype=torch.float32),
        ],
    }


@pytest.mark.parametrize("name", sorted(layouts()))
def test_store_overwrite_load_into_other_blocks(name: str) -> None:
    """Store random blocks, clobber the engine cache, load into different blocks: exact bytes."""
    _store_overwrite_load(name, WorkerConfig(cpu_num_slots=16))


@pytest.mark.parametrize("name", sorted(layouts()))
def test_copies_split_over_a_crew_of_threads_are_exact(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same round trip with every region's rows shared out over three threads (any
    share is worth a hand-off here): each block lands whole, nothing else changes."""
    monkeypatch.setattr(copy_crew, "MIN_SHARE_BYTES", 1)
    _store_overwrite_load(name, WorkerConfig(cpu_num_slots=16, copy_threads=3))


def _store_overwrite_load(name: str, config: WorkerConfig) -> None:
    kv = layouts()[name]
    fill_random(kv, seed=7)
    layout = TensorLayout.KV_FIRST if name == "kv_first" else TensorLayout.BLOCKS_FIRST
    with make_worker(config, kv, layout=layout) as worker:
        src_blocks, slots = [3, 9, 1, 30, 12, 13, 14], [0, 15, 4, 5, 6, 2, 7]
        images = [block_bytes(worker.regions, b) for b in src_blocks]
        report = run_plan(worker, job(1, Tier.GPU, Tier.CPU, src_blocks, slots))
        assert dict(report.done) == {1: 1}
        fill_random(kv, seed=8)
        untouched = {b: block_bytes(worker.regions, b) for b in range(32)}
        dst_blocks = [20, 2, 25, 26, 27, 31, 0]
        report = run_plan(worker, job(2, Tier.CPU, Tier.GPU, slots, dst_blocks))
        assert dict(report.done) == {2: 1}
        for dst, image in zip(dst_blocks, images, strict=True):
            assert block_bytes(worker.regions, dst) == image
        for block, image in untouched.items():
            if block not in dst_blocks:
                assert block_bytes(worker.regions, block) == image, f"block {block} changed"


def test_one_slot_loaded_into_several_blocks() -> None:
    """A load may read the same slot for two destinations (sources may repeat)."""
    kv = kv_per_layer(2, 8, (4, 2, 8))
    fill_random(kv, seed=9)
    with make_worker(WorkerConfig(cpu_num_slots=4), kv) as worker:
        image = block_bytes(worker.regions, 5)
        run_plan(worker, job(1, Tier.GPU, Tier.CPU, [5], [3]))
        run_plan(worker, job(2, Tier.CPU, Tier.GPU, [3, 3], [1, 2]))
        assert block_bytes(worker.regions, 1) == block_bytes(worker.regions, 2) == image


def test_large_blocks_many_runs() -> None:
    """Blocks above the per-run threshold, scattered slots: the per-run path is exact too."""
    kv = [torch.zeros(2, 24, 64, 8, 64, dtype=torch.float16)]  # 64 KiB per K or V block
    fill_random(kv, seed=10)
    with make_worker(WorkerConfig(cpu_num_slots=24), kv) as worker:
        blocks = list(range(0, 24, 2))
        slots = [23, 1, 7, 3, 19, 5, 11, 9, 15, 13, 21, 17]
        images = [block_bytes(worker.regions, b) for b in blocks]
        run_plan(worker, job(1, Tier.GPU, Tier.CPU, blocks, slots))
        fill_random(kv, seed=11)
        dst = list(range(1, 24, 2))
        run_plan(worker, job(2, Tier.CPU, Tier.GPU, slots, dst))
        assert [block_bytes(worker.regions, b) for b in dst] == images
