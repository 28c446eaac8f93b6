"""A persistent disk tier through the worker: a restarted worker keeps its disk cache."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path

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

from kvtier.core.keys import make_key
from kvtier.offload.plan import SlotRecord, Tier, TransferJob
from kvtier.storage import DiskIOMode, DiskTierBusyError
from kvtier.transfer import OffloadWorker, WorkerConfig
from kvtier.transfer.regions import TensorLayout

pytestmark = pytest.mark.timeout(60)

SLOT_KV = (16, 2, 16)  # fp16: 1 KiB per K or V block; 2 layers -> 4 KiB slots
FINGERPRINT = "tiny-model|kv fp16 2x16x2x16|sha256 seed 0"
KEY_BYTES = 36
RECORD_BYTES = 19 + KEY_BYTES + 8


def config(directory: Path, **extra: object) -> WorkerConfig:
    values: dict[str, object] = {
        "cpu_num_slots": 8,
        "disk_num_slots": 16,
        "disk_path": str(directory),
        "disk_io_mode": DiskIOMode.PAGE_CACHE,
        "disk_persist": True,
        "disk_fingerprint": FINGERPRINT,
        **extra,
    }
    return WorkerConfig(**values)  # type: ignore[arg-type]


def rec(i: int) -> SlotRecord:
    return SlotRecord(make_key(bytes([i]) * 32, 0), 16)


def store(
    event: int, src: Sequence[int], slots: Sequence[int], tier: Tier = Tier.GPU
) -> TransferJob:
    """A store into the disk tier with one record per slot (record i for slot i)."""
    records = tuple(rec(s) for s in slots)
    return TransferJob(event, tier, Tier.DISK, tuple(src), tuple(slots), records)


def paths(directory: Path) -> tuple[Path, Path]:
    return directory / "kvtier-rank0.slots", directory / "kvtier-rank0.manifest"


def new_kv(seed: int, num_blocks: int = 32) -> list[torch.Tensor]:
    kv = kv_per_layer(2, num_blocks, SLOT_KV)
    fill_random(kv, seed)
    return kv


def first_run(directory: Path, **extra: object) -> dict[int, bytes]:
    """Store blocks 1..3 to slots 3, 5, 7 (one job) and block 4 via the CPU tier to slot 9
    (demotion), all with records; shut down. Return each slot's bytes."""
    kv = new_kv(seed=1)
    with make_worker(config(directory, **extra), kv) as worker:
        assert worker.recovered_slots() == []
        images = {s: block_bytes(worker.regions, b) for b, s in ((1, 3), (2, 5), (3, 7), (4, 9))}
        assert dict(run_plan(worker, store(1, [1, 2, 3], [3, 5, 7])).done) == {1: 1}
        run_plan(worker, job(2, Tier.GPU, Tier.CPU, [4], [0]))
        assert dict(run_plan(worker, store(3, [0], [9], tier=Tier.CPU)).done) == {3: 1}
    assert all(p.exists() for p in paths(directory))
    return images


def test_config_validates_persistence() -> None:
    """Persistence needs a non-empty fingerprint; the message names the field and value."""
    with pytest.raises(ValueError, match="disk_fingerprint=''"):
        WorkerConfig(disk_persist=True)
    with pytest.raises(ValueError, match="disk_persist must be a bool"):
        WorkerConfig(disk_persist=1, disk_fingerprint="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disk_fingerprint must be a str"):
        WorkerConfig(disk_fingerprint=None)  # type: ignore[arg-type]
    cfg = WorkerConfig(
        disk_num_slots=4, disk_path="/d", rank=3, disk_persist=True, disk_fingerprint="f"
    )
    assert cfg.disk_manifest_file() == "/d/kvtier-rank3.manifest"


def test_a_persistent_tier_past_the_record_slot_ids_is_refused_at_config() -> None:
    """Manifest records hold u32 slot ids: the worker's config refuses more slots when
    persisting (before, only the disk tier's own config did, at `register()`)."""
    big = (1 << 32) + 1
    with pytest.raises(ValueError, match=f"disk_num_slots={big} "):
        WorkerConfig(disk_num_slots=big, disk_path="/d", disk_persist=True, disk_fingerprint="f")
    WorkerConfig(disk_num_slots=big, disk_path="/d")  # no manifest: no cap
    WorkerConfig(disk_num_slots=1 << 32, disk_path="/d", disk_persist=True, disk_fingerprint="f")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (DiskIOMode.PAGE_CACHE, DiskIOMode.PAGE_CACHE),
        (DiskIOMode.DIRECT, DiskIOMode.PAGE_CACHE),
        (DiskIOMode.DIRECT, DiskIOMode.DIRECT),
    ],
)
def test_restart_recovers_records_and_loads_identical_bytes(
    tmp_path: Path, first: DiskIOMode, second: DiskIOMode
) -> None:
    """Write, shut down, restart with the same fingerprint (any I/O mode): the records are
    recovered and a DISK → GPU load of a recovered slot returns the stored bytes."""
    if DiskIOMode.DIRECT in (first, second) and not direct_io_dir(str(tmp_path)):
        pytest.skip(f"O_DIRECT is not supported under {tmp_path}")
    images = first_run(tmp_path, disk_io_mode=first)
    with make_worker(config(tmp_path, disk_io_mode=second), new_kv(seed=2)) as worker:
        assert worker.recovered_slots() == [(s, rec(s)) for s in (3, 5, 7, 9)]
        report = run_plan(worker, job(1, Tier.DISK, Tier.GPU, [7, 3, 9], [20, 21, 22]))
        assert dict(report.done) == {1: 1}
        assert [block_bytes(worker.regions, b) for b in (20, 21, 22)] == [
            images[7],
            images[3],
            images[9],
        ]
        run_plan(worker, job(2, Tier.DISK, Tier.CPU, [5], [1]))  # promotion works too
        assert dict(run_plan(worker, job(3, Tier.CPU, Tier.GPU, [1], [23])).done) == {3: 1}
        assert block_bytes(worker.regions, 23) == images[5]
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:  # and a third run
        assert [s for s, _ in worker.recovered_slots()] == [3, 5, 7, 9]


def test_other_fingerprint_starts_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Never reuse across fingerprints: warning, nothing recovered, fresh file (the old
    slots no longer load)."""
    first_run(tmp_path)
    change = {"disk_fingerprint": "other-model"}
    with caplog.at_level(logging.WARNING), make_worker(config(tmp_path, **change), new_kv(2)) as w:
        assert w.recovered_slots() == []
        assert "fingerprint" in caplog.text
        assert str(paths(tmp_path)[0]) in caplog.text
        assert dict(run_plan(w, job(1, Tier.DISK, Tier.GPU, [3], [20])).failed) == {1: 1}
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:  # discarded for good
        assert worker.recovered_slots() == []


@pytest.mark.parametrize(("num_slots", "kept"), [(32, (3, 5, 7, 9)), (6, (3, 5))])
def test_another_disk_size_keeps_the_slots_that_still_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, num_slots: int, kept: tuple[int, ...]
) -> None:
    """Regression (review): changing disk_bytes discarded the whole cache ("geometry
    changed: num_slots"). A grown tier keeps every slot, a shrunk one those below its new
    end; the file takes the new size, the kept slots load their stored bytes, and the
    next run with the new size recovers the same slots."""
    images = first_run(tmp_path)
    resized = config(tmp_path, disk_num_slots=num_slots)
    with caplog.at_level(logging.WARNING), make_worker(resized, new_kv(2)) as worker:
        assert worker.recovered_slots() == [(s, rec(s)) for s in kept]
        assert f"resized from {16 * 4096} B (16 whole slots) to {num_slots} slots" in caplog.text
        assert paths(tmp_path)[0].stat().st_size == num_slots * 4096  # 4 KiB slots
        targets = list(range(20, 20 + len(kept)))
        assert dict(run_plan(worker, job(1, Tier.DISK, Tier.GPU, list(kept), targets)).done)
        assert [block_bytes(worker.regions, b) for b in targets] == [images[s] for s in kept]
    with make_worker(resized, new_kv(seed=3)) as worker:
        assert worker.recovered_slots() == [(s, rec(s)) for s in kept]


def test_other_bytes_per_slot_starts_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A KV layout with other block bytes changes the slot geometry: discarded."""
    first_run(tmp_path)
    kv = kv_per_layer(2, 32, (32, 2, 16))  # 8 KiB slots
    with caplog.at_level(logging.WARNING), make_worker(config(tmp_path), kv) as worker:
        assert worker.recovered_slots() == []
    assert "bytes_per_slot 4096 != 8192" in caplog.text
    assert paths(tmp_path)[0].stat().st_size == 16 * 8192


def test_a_corrupt_middle_record_costs_only_that_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A flipped byte in the second of three appended records: the first and the third
    are recovered and load their stored bytes, at this restart and at the next (the open
    rewrote the manifest without the corrupt record: nothing more is lost then)."""
    kv = new_kv(seed=1)
    with make_worker(config(tmp_path), kv) as worker:
        images = {slot: block_bytes(worker.regions, block) for block, slot in ((1, 2), (3, 6))}
        for event, (block, slot) in enumerate(((1, 2), (2, 4), (3, 6))):
            run_plan(worker, store(event, [block], [slot]))
    manifest = paths(tmp_path)[1]
    data = bytearray(manifest.read_bytes())
    data[len(data) - 2 * RECORD_BYTES + 3] ^= 0x10  # the slot id of the middle record
    manifest.write_bytes(bytes(data))
    for seed in (2, 3):
        with caplog.at_level(logging.WARNING), make_worker(config(tmp_path), new_kv(seed)) as w:
            assert w.recovered_slots() == [(2, rec(2)), (6, rec(6))]
            assert dict(run_plan(w, job(1, Tier.DISK, Tier.GPU, [6, 2], [20, 21])).done) == {1: 1}
            assert [block_bytes(w.regions, b) for b in (20, 21)] == [images[6], images[2]]
    assert caplog.text.count("corrupt record") == 1  # the first restart's
    assert f"skipped {RECORD_BYTES} bytes to the next valid record" in caplog.text


def test_torn_last_record_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A last record cut short by a crash is ignored; the others are recovered."""
    first_run(tmp_path)
    manifest = paths(tmp_path)[1]
    os.truncate(manifest, manifest.stat().st_size - 5)
    with caplog.at_level(logging.WARNING), make_worker(config(tmp_path), new_kv(2)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [3, 5, 7]
    assert "torn record" in caplog.text


@pytest.mark.parametrize(("num_slots", "kept"), [(6, [3, 5]), (17, [3, 5, 7, 9])])
def test_a_slot_file_of_another_size_keeps_the_slots_it_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, num_slots: int, kept: list[int]
) -> None:
    """A slot file shorter or longer than its manifest says (an interrupted resize; a
    file cut short) keeps the live slots it still holds and takes the configured size."""
    first_run(tmp_path)
    os.truncate(paths(tmp_path)[0], num_slots * 4096)
    with caplog.at_level(logging.WARNING), make_worker(config(tmp_path), new_kv(2)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == kept
    assert f"({num_slots} whole slots) to 16 slots of 4096 B" in caplog.text
    assert paths(tmp_path)[0].stat().st_size == 16 * 4096


def test_a_slot_file_cut_inside_a_slot_keeps_the_whole_slots(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first_run(tmp_path)
    os.truncate(paths(tmp_path)[0], 6 * 4096 + 1)
    with caplog.at_level(logging.WARNING), make_worker(config(tmp_path), new_kv(2)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [3, 5]
    assert "holds 24577 B, its manifest" in caplog.text
    assert paths(tmp_path)[0].stat().st_size == 16 * 4096


def test_stale_record_fails_verification_and_is_tombstoned(tmp_path: Path) -> None:
    """A record whose slot bytes changed behind it (a crash between a rewrite and its
    record) is offered, but its load fails instead of returning wrong bytes; the failed
    read tombstones it, so the next restart does not offer it again."""
    images = first_run(tmp_path)
    with open(paths(tmp_path)[0], "r+b") as raw:  # slot 5 rewritten, no record
        raw.seek(5 * 4096)
        raw.write(os.urandom(4096))
    with make_worker(config(tmp_path), new_kv(seed=2)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [3, 5, 7, 9]
        report = run_plan(worker, job(1, Tier.DISK, Tier.GPU, [5], [20]))
        assert dict(report.failed) == {1: 1}
        assert dict(run_plan(worker, job(2, Tier.DISK, Tier.GPU, [3], [21])).done) == {2: 1}
        assert block_bytes(worker.regions, 21) == images[3]
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [3, 7, 9]


def test_rewrite_without_records_forgets_the_slot(tmp_path: Path) -> None:
    """A store without dst_records drops the slot's earlier record before writing."""
    first_run(tmp_path)
    with make_worker(config(tmp_path), new_kv(seed=2)) as worker:
        assert dict(run_plan(worker, job(1, Tier.GPU, Tier.DISK, [8, 9], [3, 11])).done) == {1: 1}
        assert dict(run_plan(worker, job(2, Tier.DISK, Tier.GPU, [3], [20])).done) == {2: 1}
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [5, 7, 9]


def test_failed_write_leaves_no_recoverable_record(tmp_path: Path) -> None:
    """A failed store records nothing, and tombstones a slot that had a record (its old
    bytes may be partly overwritten)."""
    first_run(tmp_path)
    io = FaultyIO()
    with make_worker(config(tmp_path), new_kv(seed=2), io) as worker:
        io.write_errno = errno.ENOSPC
        assert dict(run_plan(worker, store(1, [1, 2], [3, 12])).failed) == {1: 1}
        io.short_writes, io.write_errno = True, None
        assert dict(run_plan(worker, store(2, [1], [13])).failed) == {2: 1}
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [5, 7, 9]


def test_slot_zero_and_other_tiers_records(tmp_path: Path) -> None:
    """Slot 0 (the null block) is never listed; records on a CPU job are ignored; a
    record that cannot be encoded is a contract violation at submit."""
    kv = new_kv(seed=1)
    with make_worker(config(tmp_path), kv) as worker:
        run_plan(worker, store(1, [1, 2], [0, 1]))
        cpu_job = TransferJob(2, Tier.GPU, Tier.CPU, (3,), (2,), (rec(2),))
        assert dict(run_plan(worker, cpu_job).done) == {2: 1}
        too_long = TransferJob(3, Tier.GPU, Tier.DISK, (4,), (4,), (SlotRecord(b"k" * 70000, 1),))
        with pytest.raises(ValueError, match="event 3: slot record key"):
            run_plan(worker, too_long)
    with make_worker(config(tmp_path), new_kv(seed=2)) as worker:
        assert worker.recovered_slots() == [(1, rec(1))]


def test_persist_off_keeps_todays_behaviour(tmp_path: Path) -> None:
    """Without persistence: records are ignored, no manifest, the file is removed at
    shutdown, nothing is recovered; a persistent run's cache is refused (naming its
    manifest) and left intact, so a later persistent run still recovers it."""
    cfg = config(tmp_path, disk_persist=False)
    with make_worker(cfg, new_kv(seed=1)) as worker:
        assert dict(run_plan(worker, store(1, [1], [3])).done) == {1: 1}
        assert worker.recovered_slots() == []
        assert os.listdir(tmp_path) == ["kvtier-rank0.slots"]
    assert os.listdir(tmp_path) == []
    images = first_run(tmp_path)
    with pytest.raises(FileExistsError, match="persistent disk tier is at this path"):
        make_worker(cfg, new_kv(seed=2))
    with make_worker(config(tmp_path), new_kv(seed=1)) as worker:
        assert [slot for slot, _ in worker.recovered_slots()] == sorted(images)


def test_persist_off_replaces_leftovers_that_no_process_holds(tmp_path: Path) -> None:
    """A crashed non-persistent run's slot file is replaced by a fresh one; a manifest
    whose slot file is gone is removed, so no later persistent run trusts it."""
    cfg = config(tmp_path, disk_persist=False)
    slots = tmp_path / "kvtier-rank0.slots"
    slots.write_bytes(b"\xff" * 4096)
    with make_worker(cfg, new_kv(seed=1)) as worker:
        assert os.path.getsize(slots) == worker.config.disk_num_slots * worker.bytes_per_slot
        assert os.listdir(tmp_path) == ["kvtier-rank0.slots"]
    first_run(tmp_path)
    os.unlink(slots)  # a persistent cache whose slot file was lost
    with make_worker(cfg, new_kv(seed=1)) as worker:
        assert os.listdir(tmp_path) == ["kvtier-rank0.slots"]
    assert os.listdir(tmp_path) == []


def test_second_worker_on_the_same_files_is_refused(tmp_path: Path) -> None:
    """Two workers must not share a persistent tier: the second fails naming the path and
    leaves the first's files alone, whatever its fingerprint or persistence."""
    with make_worker(config(tmp_path), new_kv(seed=1)) as worker:
        run_plan(worker, store(1, [1], [3]))
        for other in (config(tmp_path), config(tmp_path, disk_fingerprint="other")):
            with pytest.raises(DiskTierBusyError, match="locked by another") as info:
                make_worker(other, new_kv(seed=2))
            assert info.value.filename == str(paths(tmp_path)[0])
        run_plan(worker, store(2, [2], [4]))
    with make_worker(config(tmp_path), new_kv(seed=2)) as worker:
        assert [s for s, _ in worker.recovered_slots()] == [3, 4]
    plain = config(tmp_path, disk_persist=False, rank=1)
    with (
        make_worker(plain, new_kv(seed=3)),
        pytest.raises(DiskTierBusyError, match="locked by another"),
    ):
        make_worker(config(tmp_path, rank=1), new_kv(seed=4))


def test_a_worker_not_yet_registered_refuses_to_drop_records(tmp_path: Path) -> None:
    """Regression: `forget_slots` and `end_persistence` before register() returned quietly
    (no tier open yet), and register() then restored the records they were to drop."""
    first_run(tmp_path)
    worker = OffloadWorker(config(tmp_path))
    for name, call in (
        ("forget_slots", lambda: worker.forget_slots([3])),
        ("end_persistence", worker.end_persistence),
    ):
        with pytest.raises(RuntimeError, match=rf"{name}\(\) on a worker that is created"):
            call()
    worker.register(new_kv(seed=1), TensorLayout.KV_FIRST)
    try:
        assert len(worker.recovered_slots()) == 4
    finally:
        worker.shutdown()


def test_a_stopped_worker_refuses_to_drop_records(tmp_path: Path) -> None:
    """`forget_slots` and `end_persistence` after shutdown() raise: the tier is released,
    so a quiet return would leave the records a restart restores."""
    first_run(tmp_path)
    kv = new_kv(seed=1)
    with make_worker(config(tmp_path), kv) as worker:
        assert len(worker.recovered_slots()) == 4
    for call in (lambda: worker.forget_slots([3]), worker.end_persistence):
        with pytest.raises(RuntimeError, match="shut_down"):
            call()
    with make_worker(config(tmp_path), kv) as worker:
        assert len(worker.recovered_slots()) == 4
