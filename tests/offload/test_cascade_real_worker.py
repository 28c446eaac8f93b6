"""The offload scheduler with a CPU+disk cascade driving a real `OffloadWorker` (CPU tensors).

`SimEngine` decides what each block must hold; here every GPU block's bytes are a pattern
derived from that content, written into real KV tensors, and the real worker moves them
between the GPU tensors, the host tier and the disk file. Before every forward pass and
on every load completion the engine decodes the GPU bytes back and checks them: many
requests sharing prefixes, small tiers (evictions, demotions, disk hits, promotions), in
both cascade modes and both store modes.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch
from sim import Content, SimEngine, full_layout, make_request

from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig, StoreMode
from kvtier.offload.plan import Tier, TransferPlan, WorkerReport
from kvtier.transfer import OffloadWorker, WorkerConfig
from kvtier.transfer.regions import TensorLayout

pytestmark = pytest.mark.timeout(300)

NUM_GPU_BLOCKS = 24


class RealWorker:
    """The part of `FakeWorker` that `SimEngine` uses, over a real worker and real bytes."""

    def __init__(self, config: WorkerConfig) -> None:
        # Two layers, K and V apart: [2, blocks, 4 tokens, 2 heads, 64 dims] fp16 = 2 KiB.
        self.kv = [torch.zeros((2, NUM_GPU_BLOCKS, 4, 2, 64), dtype=torch.float16)]
        self.kv.append(torch.zeros_like(self.kv[0]))
        self.worker = OffloadWorker(config)
        self.worker.register(self.kv, TensorLayout.KV_FIRST)
        self.views = self.worker.regions.block_views()
        self.known: dict[bytes, Content] = {self._digest(None): None}
        self.in_flight: set[int] = set()
        self.gpu = [self]  # one worker; `get` decodes a GPU block's bytes
        self.jobs_by_kind: dict[tuple[Tier, Tier], int] = {}

    @staticmethod
    def _digest(content: Content) -> bytes:
        return hashlib.blake2b(repr(content).encode(), digest_size=16).digest()

    @staticmethod
    def _pattern(digest: bytes, region: int, size: int) -> torch.Tensor:
        """Return the `size` bytes a region's row holds for the content of `digest`."""
        unit = hashlib.blake2b(digest + bytes([region]), digest_size=64).digest()
        data = bytearray(unit * -(-size // len(unit)))[:size]
        return torch.frombuffer(data, dtype=torch.uint8)

    def write_gpu(self, block_id: int, content: Content) -> None:
        """The forward pass wrote `content` into a GPU block: fill it with its pattern."""
        digest = self._digest(content)
        self.known[digest] = content
        for i, view in enumerate(self.views):
            view[block_id].copy_(self._pattern(digest, i, view.shape[1]))

    def get(self, block_id: int) -> Content | str:
        """Decode a GPU block's bytes (its pattern) back to the content it encodes."""
        if not any(view[block_id].any() for view in self.views):
            return None
        for digest, content in self.known.items():
            if all(
                torch.equal(view[block_id], self._pattern(digest, i, view.shape[1]))
                for i, view in enumerate(self.views)
            ):
                return content
        return "undecodable bytes"

    def submit(self, plan: TransferPlan) -> None:
        for job in plan.jobs:
            kind = (job.src_tier, job.dst_tier)
            self.jobs_by_kind[kind] = self.jobs_by_kind.get(kind, 0) + 1
        self.worker.submit(plan)

    def complete_all(self) -> None:
        self.worker.flush()

    def take_report(self) -> WorkerReport:
        return self.worker.poll()


@pytest.mark.parametrize("store_mode", [StoreMode.EAGER, StoreMode.LAZY])
@pytest.mark.parametrize("mode", list(CascadeMode), ids=lambda m: m.value)
def test_real_bytes_survive_the_cascade(
    tmp_path: Path, mode: CascadeMode, store_mode: StoreMode
) -> None:
    config = OffloadConfig(
        cpu_bytes=1 << 20,
        disk_bytes=2 << 20,
        disk_path=str(tmp_path),
        cascade=mode,
        store_mode=store_mode,
        max_batched_tokens=16,
    )
    engine = SimEngine(
        full_layout(),
        config,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        num_tier_blocks=7,
        num_disk_blocks=20,
    )
    worker = RealWorker(
        WorkerConfig(
            cpu_num_slots=7,
            disk_num_slots=20,
            disk_path=str(tmp_path),
            disk_io_mode=DiskIOMode.PAGE_CACHE,
        )
    )
    engine.worker = worker  # type: ignore[assignment]
    rng = random.Random(0)
    prefixes = [[1000 * p + i for i in range(16)] for p in range(5)]
    try:
        for i in range(60):
            prefix = prefixes[rng.randrange(len(prefixes))][: 4 * rng.randint(1, 4)]
            tokens = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            engine.run(make_request(f"r{i}", tokens, outputs=[rng.randrange(50)]))
            if rng.randrange(2):
                engine.evict_gpu()
            engine.check()
        engine.drain(max_steps=40)
    finally:
        worker.worker.shutdown()
    kinds = worker.jobs_by_kind
    assert kinds.get((Tier.CPU, Tier.DISK), 0) > 0, kinds
    assert kinds.get((Tier.DISK, Tier.GPU), 0) > 0, kinds
    assert kinds.get((Tier.CPU, Tier.GPU), 0) > 0, kinds
