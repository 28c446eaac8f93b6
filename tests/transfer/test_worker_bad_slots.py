"""Bad disk slots in a load: the worker names them, and copies every other block whole.

A disk load whose reads all arrived but found slots failing their checksum (or holding no
valid data) reports the event failed with `WorkerReport.bad_blocks`, the bad slot ids;
every other destination block holds its slot's bytes and the bad slots' destinations are
left as they were. Any other failure (an I/O error) fails the whole event, naming nothing.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from transfer_helpers import block_bytes, fill_random, job, kv_per_layer, make_worker, run_plan

from kvtier.offload.plan import Tier
from kvtier.storage import DiskIOMode
from kvtier.transfer import WorkerConfig

pytestmark = pytest.mark.timeout(60)

SLOT_KV = (16, 2, 16)  # fp16: 1 KiB per K or V block; 2 layers -> 4 KiB slots
SLOT = 4096


def config(directory: Path, batch_slots: int, **extra: object) -> WorkerConfig:
    return WorkerConfig(
        cpu_num_slots=16,
        disk_num_slots=16,
        disk_path=str(directory),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_batch_bytes=batch_slots * SLOT,
        **extra,  # type: ignore[arg-type]
    )


def corrupt_slot(path: str, slot: int) -> None:
    with open(path, "r+b") as raw:
        raw.seek(slot * SLOT + 17)
        value = raw.read(1)[0]
        raw.seek(slot * SLOT + 17)
        raw.write(bytes([value ^ 0x80]))


class SlotReadFails:
    """A FileIO doing real I/O, except that a read covering `slot` raises EIO."""

    def __init__(self) -> None:
        self.slot: int | None = None

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        if self.slot is not None and offset <= self.slot * SLOT < offset + into.nbytes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return os.preadv(fd, [into], offset)


@pytest.mark.parametrize("batch_slots", [1, 3, 16])
@pytest.mark.parametrize("buffers", [1, 2])
def test_a_load_with_bad_slots_names_them_and_copies_every_other_block(
    tmp_path: Path, batch_slots: int, buffers: int
) -> None:
    """Two corrupted slots of eight (in one batch, or two): the event fails naming both;
    the six other destinations hold their slots' bytes, the two bad ones are untouched."""
    kv = kv_per_layer(2, 32, SLOT_KV)
    fill_random(kv, seed=21)
    cfg = config(tmp_path, batch_slots, disk_buffer_slots=buffers)
    with make_worker(cfg, kv) as w:
        blocks, slots = [1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 4, 3, 11, 5, 6, 10]
        images = {s: block_bytes(w.regions, b) for b, s in zip(blocks, slots, strict=True)}
        assert dict(run_plan(w, job(1, Tier.GPU, Tier.DISK, blocks, slots)).done) == {1: 1}
        fill_random(kv, seed=22)
        dst = [20, 21, 22, 23, 24, 25, 26, 27]
        before = {d: block_bytes(w.regions, d) for d in dst}
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 4)
        corrupt_slot(w.disk_path, 5)
        report = run_plan(w, job(2, Tier.DISK, Tier.GPU, slots, dst))
        assert (dict(report.done), dict(report.failed)) == ({}, {2: 1})
        assert dict(report.bad_blocks) == {2: frozenset({4, 5})}
        for s, d in zip(slots, dst, strict=True):
            expected = before[d] if s in (4, 5) else images[s]
            assert block_bytes(w.regions, d) == expected, f"slot {s} -> block {d}"


def test_a_never_written_slot_is_named_bad_too(tmp_path: Path) -> None:
    """A slot that holds no valid data is a bad block of the load, like a corrupted one."""
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=23)
    with make_worker(config(tmp_path, 4), kv) as w:
        image = block_bytes(w.regions, 1)
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1], [2]))
        report = run_plan(w, job(2, Tier.DISK, Tier.GPU, [2, 7], [10, 11]))
        assert (dict(report.failed), dict(report.bad_blocks)) == ({2: 1}, {2: frozenset({7})})
        assert block_bytes(w.regions, 10) == image


def test_an_io_error_beside_a_bad_slot_fails_the_whole_load(tmp_path: Path) -> None:
    """A read that fails with EIO leaves its slots unknown: the event fails naming no
    bad blocks, though another batch only had a corrupted slot."""
    io = SlotReadFails()
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=24)
    with make_worker(config(tmp_path, 1), kv, io) as w:  # type: ignore[arg-type]
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2, 3, 4], [0, 1, 2, 3]))
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 0)
        io.slot = 2
        report = run_plan(w, job(2, Tier.DISK, Tier.GPU, [0, 1, 2, 3], [8, 9, 10, 11]))
        assert (dict(report.failed), dict(report.bad_blocks)) == ({2: 1}, {})


def test_a_promotion_with_a_bad_slot_names_it(tmp_path: Path) -> None:
    """DISK -> CPU reads the same way: the bad slot is named, the other one promoted."""
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=25)
    with make_worker(config(tmp_path, 2), kv) as w:
        image = block_bytes(w.regions, 2)
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2], [3, 4]))
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 3)
        report = run_plan(w, job(2, Tier.DISK, Tier.CPU, [3, 4], [5, 6]))
        assert (dict(report.failed), dict(report.bad_blocks)) == ({2: 1}, {2: frozenset({3})})
        assert dict(run_plan(w, job(3, Tier.CPU, Tier.GPU, [6], [12])).done) == {3: 1}
        assert block_bytes(w.regions, 12) == image


class WritesFail(SlotReadFails):
    """A FileIO whose writes raise EIO."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_a_failed_store_names_no_bad_blocks_and_a_later_poll_repeats_nothing(
    tmp_path: Path,
) -> None:
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=26)
    with make_worker(config(tmp_path, 2), kv, WritesFail()) as w:  # type: ignore[arg-type]
        report = run_plan(
            w, job(1, Tier.GPU, Tier.DISK, [1], [3]), job(2, Tier.DISK, Tier.GPU, [4], [5])
        )
        assert (dict(report.failed), dict(report.bad_blocks)) == ({1: 1, 2: 1}, {2: frozenset({4})})
        assert run_plan(w).is_empty
        assert run_plan(w).bad_blocks == {}
