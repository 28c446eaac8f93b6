"""Disk tier through the worker: round trips, cascade jobs, and failures as reports."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transfer_helpers import (
    FaultyIO,
    block_bytes,
    direct_io_dir,
    fill_random,
    job,
    kv_per_layer,
    make_worker,
    run_plan,
)

from kvtier.offload.plan import Tier
from kvtier.storage import DiskIOMode
from kvtier.transfer import WorkerConfig

pytestmark = pytest.mark.timeout(60)

SLOT_KV = (16, 2, 16)  # fp16: 1 KiB per K or V block; 2 layers -> 4 KiB slots


@pytest.fixture
def direct_dir(tmp_path: Path) -> Iterator[Path]:
    """Yield a directory where O_DIRECT works: pytest's tmp dir, else one in the checkout."""
    if direct_io_dir(str(tmp_path)):
        yield tmp_path
        return
    if not direct_io_dir(os.getcwd()):
        pytest.skip(f"O_DIRECT works neither under {tmp_path} nor under {os.getcwd()}")
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".kvtier-test-") as path:
        yield Path(path)


def config(directory: Path, mode: DiskIOMode, **extra: Any) -> WorkerConfig:
    return WorkerConfig(
        cpu_num_slots=8, disk_num_slots=16, disk_path=str(directory), disk_io_mode=mode, **extra
    )


@pytest.mark.parametrize("mode", [DiskIOMode.DIRECT, DiskIOMode.PAGE_CACHE])
@pytest.mark.parametrize("batch_bytes", [4096, 3 * 4096, 1 << 20])
def test_disk_round_trip(
    tmp_path: Path, request: pytest.FixtureRequest, mode: DiskIOMode, batch_bytes: int
) -> None:
    """GPU → DISK → GPU into other blocks, exact bytes, with 1-slot, 3-slot and big batches."""
    kv = kv_per_layer(2, 32, SLOT_KV)
    fill_random(kv, seed=1)
    direct = mode is DiskIOMode.DIRECT
    directory = request.getfixturevalue("direct_dir") if direct else tmp_path
    with make_worker(config(directory, mode, disk_batch_bytes=batch_bytes), kv) as worker:
        assert worker.bytes_per_slot == 4096
        blocks, slots = [5, 1, 9, 30, 22, 7, 8], [15, 0, 3, 4, 5, 11, 2]
        images = [block_bytes(worker.regions, b) for b in blocks]
        assert dict(run_plan(worker, job(1, Tier.GPU, Tier.DISK, blocks, slots)).done) == {1: 1}
        fill_random(kv, seed=2)
        dst = [2, 3, 4, 10, 11, 12, 31]
        assert dict(run_plan(worker, job(2, Tier.DISK, Tier.GPU, slots, dst)).done) == {2: 1}
        assert [block_bytes(worker.regions, b) for b in dst] == images


def test_cascade_demote_and_promote(tmp_path: Path) -> None:
    """CPU → DISK (demote) and DISK → CPU (promote) keep the slot bytes intact."""
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=3)
    with make_worker(config(tmp_path, DiskIOMode.PAGE_CACHE), kv) as worker:
        image = block_bytes(worker.regions, 4)
        run_plan(worker, job(1, Tier.GPU, Tier.CPU, [4], [6]))
        run_plan(worker, job(2, Tier.CPU, Tier.DISK, [6], [9]))
        run_plan(worker, job(3, Tier.DISK, Tier.CPU, [9], [1]))
        report = run_plan(worker, job(4, Tier.CPU, Tier.GPU, [1], [12]))
        assert dict(report.done) == {4: 1}
        assert block_bytes(worker.regions, 12) == image


def corrupt_slot(path: str, slot: int, slot_bytes: int) -> None:
    with open(path, "r+b") as raw:
        raw.seek(slot * slot_bytes + 17)
        value = raw.read(1)[0]
        raw.seek(slot * slot_bytes + 17)
        raw.write(bytes([value ^ 0x80]))


def test_corrupted_slot_fails_the_load_and_later_jobs_work(tmp_path: Path) -> None:
    """A corrupted slot turns its load into a failed event (never done); the worker lives on."""
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=4)
    with make_worker(config(tmp_path, DiskIOMode.PAGE_CACHE, disk_batch_bytes=4096), kv) as w:
        good = block_bytes(w.regions, 2)
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2], [3, 4]))
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 3, w.bytes_per_slot)
        report = run_plan(w, job(2, Tier.DISK, Tier.GPU, [3, 4], [8, 9]))
        assert dict(report.failed) == {2: 1}
        assert 2 not in report.done
        report = run_plan(w, job(3, Tier.DISK, Tier.GPU, [4], [10]))
        assert dict(report.done) == {3: 1}
        assert block_bytes(w.regions, 10) == good


@pytest.mark.parametrize("fault", ["write_eio", "disk_full", "short_write"])
def test_store_faults_become_failed_events(tmp_path: Path, fault: str) -> None:
    """I/O error, full disk, short write: failed store; the slot then fails to load; the
    next store and load succeed."""
    io = FaultyIO()
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=5)
    with make_worker(config(tmp_path, DiskIOMode.PAGE_CACHE), kv, io) as worker:
        io.write_errno = {"write_eio": errno.EIO, "disk_full": errno.ENOSPC}.get(fault)
        io.short_writes = fault == "short_write"
        assert dict(run_plan(worker, job(1, Tier.GPU, Tier.DISK, [1, 2], [0, 1])).failed) == {1: 1}
        assert dict(run_plan(worker, job(2, Tier.DISK, Tier.GPU, [0], [5])).failed) == {2: 1}
        io.write_errno, io.short_writes = None, False
        image = block_bytes(worker.regions, 3)
        assert dict(run_plan(worker, job(3, Tier.GPU, Tier.DISK, [3], [0])).done) == {3: 1}
        assert dict(run_plan(worker, job(4, Tier.DISK, Tier.GPU, [0], [6])).done) == {4: 1}
        assert block_bytes(worker.regions, 6) == image


@pytest.mark.parametrize("fault", ["read_eio", "short_read"])
def test_load_faults_become_failed_events(tmp_path: Path, fault: str) -> None:
    """A read error or a short read fails the load; other lanes and later loads still work."""
    io = FaultyIO()
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=6)
    with make_worker(config(tmp_path, DiskIOMode.PAGE_CACHE), kv, io) as worker:
        run_plan(worker, job(1, Tier.GPU, Tier.DISK, [1], [0]))
        io.read_errno = errno.EIO if fault == "read_eio" else None
        io.short_reads = fault == "short_read"
        report = run_plan(
            worker, job(2, Tier.DISK, Tier.GPU, [0], [5]), job(3, Tier.GPU, Tier.CPU, [2], [0])
        )
        assert (dict(report.failed), dict(report.done)) == ({2: 1}, {3: 1})
        io.read_errno, io.short_reads = None, False
        assert dict(run_plan(worker, job(4, Tier.DISK, Tier.GPU, [0], [5])).done) == {4: 1}


def test_failure_in_a_later_batch_fails_the_whole_job(tmp_path: Path) -> None:
    """A job of many 1-slot batches with one corrupted slot fails as a whole."""
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=7)
    with make_worker(config(tmp_path, DiskIOMode.PAGE_CACHE, disk_batch_bytes=4096), kv) as w:
        run_plan(w, job(1, Tier.GPU, Tier.DISK, list(range(1, 9)), list(range(8))))
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 6, w.bytes_per_slot)
        assert dict(
            run_plan(w, job(2, Tier.DISK, Tier.GPU, list(range(8)), list(range(8, 16)))).failed
        ) == {2: 1}


class FirstWriteFails:
    """A FileIO whose first write raises EIO; every other call is real I/O."""

    def __init__(self) -> None:
        self.writes = 0

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self.writes += 1
        if self.writes == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        return os.preadv(fd, [into], offset)


def test_failed_first_batch_of_a_long_store_fails_the_whole_job(tmp_path: Path) -> None:
    """A store of more batches than staging buffers whose first batch fails to write is
    reported failed, though the next batch was written meanwhile (SPEC §7: a failure is
    never lost); the job stops there, the slot it failed on holds nothing, and the worker
    lives on."""
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=8)
    io = FirstWriteFails()
    cfg = config(tmp_path, DiskIOMode.PAGE_CACHE, disk_batch_bytes=4096, disk_buffer_slots=2)
    with make_worker(cfg, kv, io) as w:  # type: ignore[arg-type]
        report = run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2, 3, 4], [0, 1, 2, 3]))
        assert (dict(report.done), dict(report.failed)) == ({}, {1: 1})
        assert io.writes == 2  # batches 0 and 1: none is started after the failure
        assert dict(run_plan(w, job(2, Tier.DISK, Tier.GPU, [0], [9])).failed) == {2: 1}
        assert dict(run_plan(w, job(3, Tier.DISK, Tier.GPU, [1], [9])).done) == {3: 1}
        assert block_bytes(w.regions, 9) == block_bytes(w.regions, 2)


def test_direct_io_rejects_unaligned_slots_at_register(tmp_path: Path) -> None:
    """SPEC scenario 28 through the worker: 3 KiB slots need page-cache mode."""
    kv = [torch.zeros(2, 8, 16, 2, 24, dtype=torch.float16)]  # 2 x 1.5 KiB = 3 KiB slots
    cfg = WorkerConfig(disk_num_slots=4, disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="bytes_per_slot=3072"):
        make_worker(cfg, kv)
    assert os.listdir(tmp_path) == []
    paged = WorkerConfig(
        disk_num_slots=4, disk_path=str(tmp_path), disk_io_mode=DiskIOMode.PAGE_CACHE
    )
    with make_worker(paged, kv) as worker:
        assert dict(run_plan(worker, job(1, Tier.GPU, Tier.DISK, [1], [1])).done) == {1: 1}
