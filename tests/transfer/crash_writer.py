"""A process that keeps writing a persistent disk tier until it dies (for
test_worker_crash.py): `python crash_writer.py DIRECTORY SEED KILL_POINT ARM_AFTER`.

Every store copies GPU blocks filled with `key_image(key_id)` to random disk slots
under the record of that key, so any recovered (slot, record) pair has one right image.
Some stores go through the CPU tier (a demotion), some carry no records (the slot's
record is dropped), some read a slot back. The manifest compacts every few dozen records
(its floor lowered from 4096). Prints `ready` once the tier is open, then `stored N`
after each finished job.

After ARM_AFTER jobs the process SIGKILLs itself at KILL_POINT (`KILL_POINTS`):
`write` half-way through writing a store's slot bytes, `record` after the bytes and
before their manifest record, `compaction` after a compacted manifest is written and
before it replaces the old one; with `none` it runs until the test kills it. At `write`
and `record`, the armed job is a store into slots that hold a record, so the kill tests
that their old records were tombstoned before the slots were overwritten.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

import kvtier.storage.manifest_compaction as manifest_compaction
import kvtier.storage.manifest_log as manifest_log
from kvtier.core.keys import Key, key_block_hash, make_key
from kvtier.offload.plan import SlotRecord, Tier, TransferJob, TransferPlan
from kvtier.storage import DiskIOMode
from kvtier.storage.slot_file import SlotFile
from kvtier.transfer import OffloadWorker, WorkerConfig
from kvtier.transfer.regions import TensorLayout

SLOT_KV = (16, 8, 64)  # fp16 blocks: 16 KiB per K or V block, 2 layers -> 64 KiB slots
NUM_LAYERS = 2
NUM_GPU_BLOCKS = 16
MAX_SLOTS_PER_JOB = 6
FINGERPRINT = "crash-test|kv fp16 2x16x8x64"
COMPACT_FLOOR = 48
KILL_POINTS = ("write", "record", "compaction", "none")


def config(directory: str) -> WorkerConfig:
    return WorkerConfig(
        cpu_num_slots=MAX_SLOTS_PER_JOB,
        disk_num_slots=24,
        disk_path=directory,
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=True,
        disk_fingerprint=FINGERPRINT,
    )


def new_kv() -> list[torch.Tensor]:
    shape = (2, NUM_GPU_BLOCKS, *SLOT_KV)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(NUM_LAYERS)]


def key_of(key_id: int) -> Key:
    return make_key(key_id.to_bytes(32, "little"), 0)


def key_id_of(key: Key) -> int:
    return int.from_bytes(key_block_hash(key), "little")


def key_image(key_id: int) -> list[torch.Tensor]:
    """Return the K/V content of the block stored under `key_id`, one tensor per layer."""
    gen = torch.Generator().manual_seed(key_id)
    return [torch.randn((2, *SLOT_KV), generator=gen).half() for _ in range(NUM_LAYERS)]


def fill(kv: Sequence[torch.Tensor], block_id: int, key_id: int) -> None:
    for layer, image in zip(kv, key_image(key_id), strict=True):
        layer[:, block_id].copy_(image)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillSwitch:
    """Kill this process at `point` once `arm()` was called (see the module docstring)."""

    def __init__(self, point: str) -> None:
        if point not in KILL_POINTS:
            raise ValueError(f"kill point {point!r} is not one of {KILL_POINTS}")
        self.armed = False
        write, put, replace = SlotFile.write, manifest_log.ManifestLog.put, os.replace
        if point == "write":

            def half_write(slot_file: SlotFile, data: memoryview, first_slot: int) -> None:
                if self.armed:  # half the bytes land, the process dies
                    offset = first_slot * slot_file.bytes_per_slot
                    os.pwrite(slot_file._handle.fd, data[: len(data) // 2], offset)  # type: ignore[arg-type]
                    die()
                write(slot_file, data, first_slot)

            SlotFile.write = half_write  # type: ignore[method-assign]
        elif point == "record":
            self._wrap(manifest_log.ManifestLog, "put", put)
        elif point == "compaction":
            manifest_compaction.os = _OsWithReplace(self, replace)  # type: ignore[attr-defined]

    def arm(self) -> None:
        self.armed = True

    def _wrap(self, cls: type, name: str, method: Callable[..., Any]) -> None:
        def killing(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                die()
            return method(*args, **kwargs)

        setattr(cls, name, killing)


class _OsWithReplace:
    """`os` for the compaction module, whose `replace` kills once the switch is armed."""

    def __init__(self, switch: KillSwitch, replace: Callable[[str, str], None]) -> None:
        self._switch, self._replace = switch, replace

    def replace(self, src: str, dst: str) -> None:
        if self._switch.armed:
            die()
        self._replace(src, dst)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def run(worker: OffloadWorker, job: TransferJob) -> None:
    worker.submit(TransferPlan(step_id=0, jobs=(job,)))
    worker.flush()
    worker.poll()


def store_job(
    rng: random.Random, kv: Sequence[torch.Tensor], event: int, slots: list[int]
) -> tuple[TransferJob, ...]:
    """Return the jobs of one store of fresh keys into `slots` (maybe via the CPU tier)."""
    key_ids = [rng.randrange(1, 1 << 16) for _ in slots]
    gpu_ids = tuple(range(1, len(slots) + 1))
    for block_id, key_id in zip(gpu_ids, key_ids, strict=True):
        fill(kv, block_id, key_id)
    records = tuple(SlotRecord(key_of(k), 16) for k in key_ids)
    if rng.random() < 0.2:  # through the CPU tier, as a demotion
        cpu_ids = tuple(range(len(slots)))
        return (
            TransferJob(event, Tier.GPU, Tier.CPU, gpu_ids, cpu_ids),
            TransferJob(event + 1, Tier.CPU, Tier.DISK, cpu_ids, tuple(slots), records),
        )
    return (TransferJob(event, Tier.GPU, Tier.DISK, gpu_ids, tuple(slots), records),)


def main(directory: str, seed: int, kill_point: str, arm_after: int) -> None:
    floor_free = manifest_log.compaction_due
    manifest_log.compaction_due = lambda records, live, floor: floor_free(
        records, live, COMPACT_FLOOR
    )
    switch = KillSwitch(kill_point)
    rng = random.Random(seed)
    kv = new_kv()
    num_slots = config(directory).disk_num_slots
    with OffloadWorker(config(directory)) as worker:
        worker.register(kv, TensorLayout.KV_FIRST)
        # Slots holding a record (recovered, or written here with one): the armed store
        # overwrites some, so a kill inside it finds old records to have been tombstoned.
        recorded = {slot for slot, _ in worker.recovered_slots()}
        print("ready", flush=True)
        event = 0
        for num_jobs in range(1, sys.maxsize):
            if num_jobs > arm_after:
                switch.arm()
            slots = rng.sample(range(1, num_slots), rng.randint(1, MAX_SLOTS_PER_JOB))
            kind = rng.random()
            if switch.armed and kill_point in ("write", "record") and recorded:
                kind = 1.0  # a store with records, into slots that hold one
                slots = rng.sample(sorted(recorded), min(len(slots), len(recorded)))
            if kind < 0.1:  # read a slot back (no change on disk)
                jobs: tuple[TransferJob, ...] = (
                    TransferJob(event + 1, Tier.DISK, Tier.GPU, (slots[0],), (1,)),
                )
            elif kind < 0.2:  # a rewrite without records: the slot's record is dropped
                jobs = (TransferJob(event + 1, Tier.GPU, Tier.DISK, (2,), (slots[0],)),)
            else:
                jobs = store_job(rng, kv, event + 1, slots)
            for job in jobs:
                run(worker, job)
                if job.dst_tier is Tier.DISK:
                    if job.dst_records:
                        recorded.update(job.dst_block_ids)
                    else:
                        recorded.difference_update(job.dst_block_ids)
            event += len(jobs)
            print("stored", num_jobs, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
