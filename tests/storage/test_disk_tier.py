"""The disk tier: batched slot I/O with per-slot checksums on its own I/O threads."""

from __future__ import annotations

import errno
import os
import threading
import warnings
import weakref
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from storage_helpers import (
    WAIT_S,
    FlakyIO,
    GatedIO,
    collect,
    direct_io_dir,
    join_all,
    num_open_fds,
    start_until_parked,
)

from kvtier.offload.plan import SlotRecord
from kvtier.storage import (
    DiskIOError,
    DiskIOMode,
    DiskTier,
    DiskTierConfig,
    SlotFile,
    StagingBuffer,
)

SLOT = 8192

pytestmark = pytest.mark.timeout(60)


def make_tier(tmp_path: Path, mode: DiskIOMode, io: FlakyIO | GatedIO | None = None) -> DiskTier:
    base = direct_io_dir(str(tmp_path)) if mode is DiskIOMode.DIRECT else str(tmp_path)
    config = DiskTierConfig(
        os.path.join(base, "rank0.slots"),
        num_slots=16,
        bytes_per_slot=SLOT,
        io_mode=mode,
        batch_bytes=4 * SLOT,
    )
    tier = DiskTier(config, io)
    tier.check_invariants()
    return tier


def fill(buffer: StagingBuffer, rows: int, seed: int) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    buffer.tensor[:rows] = torch.randint(0, 256, (rows, SLOT), dtype=torch.uint8, generator=gen)
    return [buffer.tensor[i].numpy().tobytes() for i in range(rows)]


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.mark.parametrize("mode", [DiskIOMode.DIRECT, DiskIOMode.PAGE_CACHE])
def test_write_then_read_returns_the_same_bytes(tmp_path: Path, mode: DiskIOMode) -> None:
    """Rows written to scattered slots read back in another order into another buffer."""
    tier = make_tier(tmp_path, mode)
    images = fill(tier.store_buffers[0], 4, seed=1)
    tier.write_slots(tier.store_buffers[0], ids(3, 4, 9, 15)).result()
    out = tier.load_buffers[1]
    tier.read_slots(out, ids(15, 3, 9)).result()
    assert [out.tensor[i].numpy().tobytes() for i in range(3)] == [images[3], images[0], images[2]]
    tier.check_invariants()
    tier.close()
    tier.close()
    assert not os.path.exists(tier.path)


def test_corrupted_slot_fails_its_checksum(tmp_path: Path) -> None:
    """A byte flipped in the file behind the tier's back makes that slot's read fail."""
    tier = make_tier(tmp_path, DiskIOMode.PAGE_CACHE)
    fill(tier.store_buffers[0], 2, seed=2)
    tier.write_slots(tier.store_buffers[0], ids(5, 6)).result()
    with open(tier.path, "r+b") as raw:
        raw.seek(6 * SLOT + 100)
        byte = raw.read(1)
        raw.seek(6 * SLOT + 100)
        raw.write(bytes([byte[0] ^ 0x01]))
    tier.read_slots(tier.load_buffers[0], ids(5)).result()
    with pytest.raises(DiskIOError, match="checksum mismatch in slot 6"):
        tier.read_slots(tier.load_buffers[0], ids(5, 6)).result()
    tier.close()


def test_unwritten_and_failed_slots_do_not_load(tmp_path: Path) -> None:
    """A never-written slot, and one whose rewrite failed, hold no valid data."""
    io = FlakyIO()
    tier = make_tier(tmp_path, DiskIOMode.PAGE_CACHE, io)
    with pytest.raises(DiskIOError, match="slot 0 holds no valid data"):
        tier.read_slots(tier.load_buffers[0], ids(0)).result()
    fill(tier.store_buffers[0], 1, seed=3)
    tier.write_slots(tier.store_buffers[0], ids(1)).result()
    io.write_errno = errno.ENOSPC
    with pytest.raises(DiskIOError, match="No space left"):
        tier.write_slots(tier.store_buffers[0], ids(1)).result()
    io.write_errno = None
    with pytest.raises(DiskIOError, match="slot 1 holds no valid data"):
        tier.read_slots(tier.load_buffers[0], ids(1)).result()
    io.read_errno = errno.EIO
    fill(tier.store_buffers[1], 1, seed=4)
    tier.write_slots(tier.store_buffers[1], ids(2)).result()
    with pytest.raises(DiskIOError, match="Input/output error"):
        tier.read_slots(tier.load_buffers[0], ids(2)).result()
    io.read_errno = None
    tier.read_slots(tier.load_buffers[0], ids(2)).result()  # the thread lives on
    tier.close()


def test_slot_ids_reused_by_the_caller_after_queueing_change_nothing(tmp_path: Path) -> None:
    """`write_slots` and `read_slots` act on the slot ids as passed: a caller that reuses
    its id array once the call returned (the I/O still queued) neither writes, validates
    nor verifies other slots (SPEC §7: a load never returns wrong bytes)."""
    io = GatedIO()
    tier = make_tier(tmp_path, DiskIOMode.PAGE_CACHE, io)
    images = fill(tier.store_buffers[0], 2, seed=11)
    slots = ids(2, 3)
    written = tier.write_slots(tier.store_buffers[0], slots)
    assert io.writing.wait(WAIT_S)  # the I/O thread holds the write
    slots[:] = ids(7, 8)
    io.release.set()
    written.result()
    with pytest.raises(DiskIOError, match="slot 7 holds no valid data"):
        tier.read_slots(tier.load_buffers[0], ids(7)).result()
    fill(tier.store_buffers[1], 2, seed=12)
    tier.write_slots(tier.store_buffers[1], ids(7, 8)).result()
    out, wanted = tier.load_buffers[0], ids(2, 3)
    read = tier.read_slots(out, wanted)
    wanted[:] = ids(7, 8)
    read.result()
    assert [out.tensor[i].numpy().tobytes() for i in range(2)] == images
    tier.close()


def test_buffers_are_aligned_and_batches_are_whole_slots(tmp_path: Path) -> None:
    """Staging buffers hold batch_bytes // slot bytes slots, 4096-aligned, per direction."""
    tier = make_tier(tmp_path, DiskIOMode.PAGE_CACHE)
    assert tier.batch_slots == 4
    assert len(tier.store_buffers) == len(tier.load_buffers) == 2
    assert all(b.tensor.data_ptr() % 4096 == 0 for b in (*tier.store_buffers, *tier.load_buffers))
    with pytest.raises(ValueError, match="do not fit a 4-slot buffer"):
        tier.write_slots(tier.store_buffers[0], ids(0, 1, 2, 3, 4))
    with pytest.raises(ValueError, match="outside"):
        tier.read_slots(tier.load_buffers[0], ids(16))
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.write_slots(tier.store_buffers[0], ids(0))


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_slots", 0), ("bytes_per_slot", -1), ("batch_bytes", 0), ("num_buffers", 0)],
)
def test_config_rejects_non_positive_sizes(field: str, value: int) -> None:
    """Every size of the disk tier config must be positive; the message names the field."""
    kwargs = {"path": "x.slots", "num_slots": 4, "bytes_per_slot": 4096, field: value}
    with pytest.raises(ValueError, match=field):
        DiskTierConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [("io_mode", "direct"), ("num_slots", True), ("bytes_per_slot", 4096.0), ("num_buffers", 2.5)],
)
def test_config_rejects_values_of_the_wrong_type(field: str, value: object) -> None:
    """Regression: io_mode="direct" (a string) was accepted and the tier silently did
    page-cache I/O without the 4096-byte alignment check; True counted as 1 slot."""
    kwargs = {"path": "x.slots", "num_slots": 4, "bytes_per_slot": 4096, field: value}
    with pytest.raises(ValueError, match=f"{field} must be .* got {value!r}"):
        DiskTierConfig(**kwargs)  # type: ignore[arg-type]


def test_slot_file_rejects_a_mode_that_is_not_a_disk_io_mode(tmp_path: Path) -> None:
    """Regression: SlotFile(..., "direct") opened the file without O_DIRECT."""
    path = str(tmp_path / "rank0.slots")
    with pytest.raises(ValueError, match="must be a DiskIOMode, got 'direct'"):
        SlotFile(path, 4, 100, "direct")  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_persistent_tier_recovers_checksums_and_records(tmp_path: Path) -> None:
    """Records written with the data survive a close; the reopened tier verifies reads
    against the recovered checksums and keeps both files."""
    config = DiskTierConfig(
        str(tmp_path / "rank0.slots"),
        num_slots=16,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        fingerprint="fp",
    )
    tier = DiskTier(config)
    images = fill(tier.store_buffers[0], 2, seed=5)
    records = [SlotRecord(b"k1", 16), SlotRecord(b"k2", 7)]
    tier.write_slots(tier.store_buffers[0], ids(9, 4), records).result()
    with pytest.raises(ValueError, match="1 records for 2 slots"):
        tier.write_slots(tier.store_buffers[0], ids(1, 2), records[:1])
    tier.close()
    assert sorted(os.listdir(tmp_path)) == ["rank0.manifest", "rank0.slots"]
    tier = DiskTier(config)
    tier.check_invariants()
    assert tier.recovered_slots() == [(4, records[1]), (9, records[0])]
    tier.read_slots(tier.load_buffers[0], ids(4, 9)).result()
    assert [tier.load_buffers[0].tensor[i].numpy().tobytes() for i in range(2)] == images[::-1]
    tier.close()
    with pytest.raises(ValueError, match="fingerprint must be None or a non-empty"):
        DiskTierConfig("x.slots", num_slots=4, bytes_per_slot=4096, fingerprint="")


def test_a_dropped_tier_releases_its_file(tmp_path: Path) -> None:
    """Regression: a tier dropped without close() kept its descriptor, lock and file, so
    a new tier on the same path got DiskTierBusyError. Collection now closes it."""
    num_fds = num_open_fds()
    tier = make_tier(tmp_path, DiskIOMode.PAGE_CACHE)
    fill(tier.store_buffers[0], 2, seed=6)
    tier.write_slots(tier.store_buffers[0], ids(0, 1)).result()
    path, ref = tier.path, weakref.ref(tier)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del tier
        collect(ref)  # the store thread may hold the tier until its task is dropped
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == [
        f"disk tier {path} was not closed; closed it at collection"
    ]
    assert num_open_fds() == num_fds
    assert not os.path.exists(path)
    make_tier(tmp_path, DiskIOMode.PAGE_CACHE).close()


def test_a_dropped_persistent_tier_is_kept_as_close_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A persistent tier collected without close() syncs the slot file and the manifest
    and keeps both, as close() does; the next tier recovers every slot."""
    config = DiskTierConfig(
        str(tmp_path / "rank0.slots"), 16, SLOT, DiskIOMode.PAGE_CACHE, fingerprint="fp"
    )
    num_fds = num_open_fds()
    tier = DiskTier(config)
    images = fill(tier.store_buffers[0], 2, seed=7)
    records = [SlotRecord(b"k1", 16), SlotRecord(b"k2", 7)]
    tier.write_slots(tier.store_buffers[0], ids(2, 3), records).result()
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ref = weakref.ref(tier)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del tier
        collect(ref)
    monkeypatch.undo()
    assert [w.category for w in caught] == [ResourceWarning]
    assert synced == [os.stat(config.path).st_ino, os.stat(tmp_path / "rank0.manifest").st_ino]
    assert num_open_fds() == num_fds
    tier = DiskTier(config)
    assert tier.recovered_slots() == [(2, records[0]), (3, records[1])]
    tier.read_slots(tier.load_buffers[0], ids(2, 3)).result()
    assert [tier.load_buffers[0].tensor[i].numpy().tobytes() for i in range(2)] == images
    tier.close()


def test_a_second_close_returns_only_once_the_first_finished(tmp_path: Path) -> None:
    """Regression: close() marked the tier closed before its I/O threads finished, so a
    second close() meanwhile (another thread, a finalizer) returned at once, its caller
    believing the tier closed while the first was still writing and the file still there.
    Now every close() returns once the tier is closed."""
    io = GatedIO()
    tier = make_tier(tmp_path, DiskIOMode.PAGE_CACHE, io)
    fill(tier.store_buffers[0], 1, seed=8)
    written = tier.write_slots(tier.store_buffers[0], ids(0))
    assert io.writing.wait(WAIT_S)
    file_left: dict[str, bool] = {}

    def close(name: str) -> None:
        tier.close()
        file_left[name] = os.path.exists(tier.path)

    first = start_until_parked(lambda: close("first"), "first")  # waits for the write
    second = start_until_parked(lambda: close("second"), "second")  # waits for the first
    assert file_left == {}
    io.release.set()
    join_all(first, second)
    assert file_left == {"first": False, "second": False}
    assert written.done()
    assert written.exception() is None
    tier.check_invariants()


def test_close_from_an_io_thread_neither_waits_for_itself_nor_raises(tmp_path: Path) -> None:
    """Regression: close() from a future's done-callback, which the I/O thread runs, joined
    that very thread and raised RuntimeError, leaving the tier open. It now hands the
    close to a new thread; a later close() returns once the tier is closed."""
    io = GatedIO()
    tier = make_tier(tmp_path, DiskIOMode.PAGE_CACHE, io)
    fill(tier.store_buffers[0], 1, seed=9)
    written = tier.write_slots(tier.store_buffers[0], ids(0))
    assert io.writing.wait(WAIT_S)  # still pending: its callbacks run on the I/O thread
    outcome: list[BaseException | None] = []
    called_back = threading.Event()

    def close_from_callback(_: Future[None]) -> None:
        try:
            tier.close()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            called_back.set()

    written.add_done_callback(close_from_callback)
    io.release.set()
    assert called_back.wait(WAIT_S)
    assert outcome == [None]
    with pytest.raises(RuntimeError, match="closed"):
        tier.write_slots(tier.store_buffers[0], ids(1))
    tier.close()
    assert not os.path.exists(tier.path)
    tier.check_invariants()


def test_close_reentered_by_its_own_thread_returns_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close() re-entered by the thread running it (a finalizer run by a collection
    inside it calls close() again) returns instead of waiting for itself."""
    config = DiskTierConfig(
        str(tmp_path / "rank0.slots"), 16, SLOT, DiskIOMode.PAGE_CACHE, fingerprint="fp"
    )
    tier = DiskTier(config)
    real_fsync = os.fsync

    def fsync_and_close_again(fd: int) -> None:
        tier.close()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_and_close_again)
    tier.close()
    monkeypatch.undo()
    tier.check_invariants()
    DiskTier(config).close()
