"""Factories and checkers for worker-side tests (and a later scheduler + worker test).

`ShadowTiers` mirrors what every lower-tier slot should hold: feed it each plan before
`submit` and each report after `poll`, and it returns every byte mismatch a finished load
produced. It only assumes what the scheduler guarantees: a block under transfer is not
written by anyone else until its event is reported.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport
from kvtier.transfer import OffloadWorker, WorkerConfig
from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.regions import RegionSet, TensorLayout


def reference_copy(
    src: torch.Tensor, src_ids: np.ndarray, dst: torch.Tensor, dst_ids: np.ndarray
) -> torch.Tensor:
    """Return what `dst` must look like after copying rows `src_ids` to `dst_ids` (one
    row at a time)."""
    out = dst.clone()
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        out[d] = src[s]
    return out


def random_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Return `[rows, width]` random bytes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen)


def kv_per_layer(
    num_layers: int,
    num_blocks: int,
    block_shape: tuple[int, ...] = (16, 2, 16),
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Return vLLM-FlashAttention-style caches `[2, num_blocks, *block_shape]` (fp16)."""
    shape = (2, num_blocks, *block_shape)
    return [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(num_layers)]


def fill_random(tensors: Sequence[torch.Tensor], seed: int) -> None:
    """Overwrite every byte of the storages behind `tensors` with seeded random bytes."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in tensors:
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        flat.set_(tensor.untyped_storage())
        noise = torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen)
        flat.copy_(noise.to(tensor.device))


def block_bytes(regions: RegionSet, block_id: int) -> bytes:
    """Return the slot image of engine block `block_id` (all regions, in slot order)."""
    return b"".join(view[block_id].cpu().numpy().tobytes() for view in regions.block_views())


def direct_io_dir(base: str) -> str | None:
    """Return `base` when O_DIRECT works there, else None."""
    probe = os.path.join(base, ".kvtier-odirect-probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    os.close(fd)
    os.unlink(probe)
    return base


def opened_gate() -> threading.Event:
    gate = threading.Event()
    gate.set()
    return gate


@dataclass(slots=True)
class FaultyIO:
    """A FileIO doing real I/O, with faults to arm: an errno to raise, short transfers, or
    a closed `gate` that holds every call until opened (or GATE_TIMEOUT_S passes)."""

    write_errno: int | None = None
    read_errno: int | None = None
    short_writes: bool = False
    short_reads: bool = False
    gate: threading.Event = field(default_factory=opened_gate)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self._wait()
        if self.write_errno is not None:
            raise OSError(self.write_errno, os.strerror(self.write_errno))
        if self.short_writes:
            return data.nbytes // 2
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        self._wait()
        if self.read_errno is not None:
            raise OSError(self.read_errno, os.strerror(self.read_errno))
        if self.short_reads:
            return into.nbytes // 2
        return os.preadv(fd, [into], offset)

    def _wait(self) -> None:
        if not self.gate.wait(GATE_TIMEOUT_S):
            raise OSError(errno.ETIMEDOUT, "test gate never opened")


GATE_TIMEOUT_S = 20


def take_finished(lane: TransferLane) -> tuple[dict[int, float], dict[int, BaseException]]:
    """Return the lane's finished jobs (done: copy seconds; failed: error) and let go of
    them, as `OffloadWorker.poll` does."""
    finished = lane.finished()
    lane.acknowledge()
    return finished


def make_worker(
    config: WorkerConfig,
    kv: Sequence[torch.Tensor],
    file_io: FaultyIO | None = None,
    layout: TensorLayout = TensorLayout.KV_FIRST,
) -> OffloadWorker:
    """Return a worker registered on `kv` (by default `kv_per_layer`'s caches)."""
    worker = OffloadWorker(config, file_io)
    worker.register(list(kv), layout)
    worker.check_invariants()
    return worker


def job(
    event_id: int, src: Tier, dst: Tier, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> TransferJob:
    """Return a transfer job (shorthand)."""
    return TransferJob(event_id, src, dst, tuple(src_ids), tuple(dst_ids))


def run_plan(worker: OffloadWorker, *jobs: TransferJob, need_flush: bool = False) -> WorkerReport:
    """Submit one plan, wait for it, and return the report."""
    worker.submit(TransferPlan(step_id=0, jobs=jobs, need_flush=need_flush))
    worker.flush()
    report = worker.poll()
    worker.check_invariants()
    return report


@dataclass(slots=True)
class ShadowTiers:
    """Expected bytes of every lower-tier slot; checks loads byte-for-byte."""

    regions: RegionSet
    slots: dict[tuple[Tier, int], bytes] = field(default_factory=dict)
    _pending: dict[int, tuple[TransferJob, list[bytes]]] = field(default_factory=dict)

    def on_submit(self, plan: TransferPlan) -> None:
        """Snapshot the source bytes of every job (call right before `submit`)."""
        for tjob in plan.jobs:
            sources = [self._read(tjob.src_tier, block) for block in tjob.src_block_ids]
            self._pending[tjob.event_id] = (tjob, sources)

    def on_report(self, report: WorkerReport) -> list[str]:
        """Apply finished jobs; return a message per wrong byte image a load produced."""
        problems: list[str] = []
        for event_id in report.failed:
            tjob, _ = self._pending.pop(event_id)
            if tjob.dst_tier is not Tier.GPU:
                for slot in tjob.dst_block_ids:  # a failed store leaves nothing usable
                    self.slots.pop((tjob.dst_tier, slot), None)
        for event_id in report.done:
            tjob, sources = self._pending.pop(event_id)
            for slot, data, dst in zip(
                tjob.src_block_ids, sources, tjob.dst_block_ids, strict=True
            ):
                if tjob.dst_tier is not Tier.GPU:
                    self.slots[(tjob.dst_tier, dst)] = data
                elif block_bytes(self.regions, dst) != data:
                    problems.append(
                        f"event {event_id}: GPU block {dst} differs from "
                        f"{tjob.src_tier.value} slot {slot}"
                    )
        return problems

    def _read(self, tier: Tier, block: int) -> bytes:
        if tier is Tier.GPU:
            return block_bytes(self.regions, block)
        return self.slots.get((tier, block), b"")


def random_plan(
    rng: np.random.Generator, shadow: ShadowTiers, event_id: int, sizes: dict[Tier, int]
) -> TransferPlan:
    """Return a plan of random stores plus loads of already-stored slots.

    Like a real scheduler's plan, no block is both read and written by the plan: loads
    never target a store's source blocks nor read a slot a store of the plan overwrites.
    """
    num_blocks = shadow.regions.num_blocks
    blocks = rng.permutation(np.arange(1, num_blocks)).tolist()  # block 0 is the null block
    jobs = []
    busy_slots: set[tuple[Tier, int]] = set()
    for tier, num_slots in sizes.items():
        n = int(rng.integers(1, 9))
        src, blocks = blocks[:n], blocks[n:]
        slots = rng.choice(num_slots, n, replace=False).tolist()
        busy_slots.update((tier, s) for s in slots)
        jobs.append(job(event_id, Tier.GPU, tier, src, slots))
        event_id += 1
    for tier in sizes:
        stored = sorted(s for t, s in shadow.slots if t is tier and (t, s) not in busy_slots)
        n = min(int(rng.integers(1, 9)), len(stored), len(blocks))
        if n == 0:
            continue
        slots = rng.choice(stored, n, replace=False).tolist()
        dst, blocks = blocks[:n], blocks[n:]
        jobs.append(job(event_id, tier, Tier.GPU, slots, dst))
        event_id += 1
    return TransferPlan(step_id=event_id, jobs=tuple(jobs))
