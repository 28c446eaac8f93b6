"""Disk tier edges: closing from an I/O thread and with I/O queued, stores that never
wait behind loads, a second `end_persistence`, a bad slot's error surviving a failed
record drop, recovered slots and manifest syncs around writes, both syncs failing at
close, a reopen under another region layout, and the staging buffer's slot cap."""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import stat
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

import pytest
from storage_helpers import WAIT_S, GatedIO, join_all, start_until_parked
from test_disk_tier_inputs import SLOT, config, ids

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOError, DiskTier, DiskTierConfig
from kvtier.storage.slot_file import BadSlotsError

pytestmark = pytest.mark.timeout(60)


def test_a_close_from_an_io_thread_lets_the_io_queued_behind_it_finish(tmp_path: Path) -> None:
    """close() from a write's done-callback (on the store I/O thread) refuses new I/O at
    once, yet the write queued behind that one still lands: the close runs on another
    thread, after the queue drained, not inline on the I/O thread with the file closed
    under the queued write."""
    io = GatedIO()
    tier = DiskTier(config(tmp_path, fingerprint=None), io)
    tier.store_buffers[0].tensor[:1] = 1
    tier.store_buffers[1].tensor[:1] = 2
    first = tier.write_slots(tier.store_buffers[0], ids(0))
    assert io.writing.wait(WAIT_S)
    behind = tier.write_slots(tier.store_buffers[1], ids(1))
    outcome: list[str] = []
    closers: list[bool] = []
    called_back = threading.Event()

    def close_from_callback(_: Future[None]) -> None:
        try:
            tier.close()
            # The closer waits for this thread: alive, and not a daemon, so an exit
            # meanwhile waits for it to finish the close.
            closers.extend(t.daemon for t in threading.enumerate() if t.name == "kvtier-disk-close")
            tier.write_slots(tier.store_buffers[0], ids(2))
            outcome.append("queued after close")
        except RuntimeError as exc:
            outcome.append(str(exc))
        finally:
            called_back.set()

    first.add_done_callback(close_from_callback)
    io.release.set()
    assert called_back.wait(WAIT_S)
    assert outcome == [f"disk tier {tier.path} is closed"]
    assert closers == [False]
    try:
        behind.result(WAIT_S)
    except DiskIOError as exc:
        pytest.fail(f"the write queued behind the closing callback failed: {exc}")
    tier.close()
    assert not os.path.exists(tier.path)


class _UnstartableThread(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")


def test_a_close_from_an_io_thread_that_cannot_start_its_closer_still_refuses_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At interpreter exit no thread starts: the close from the I/O thread logs that it
    cannot close, yet new I/O is refused from then on (the finalizer closes the files),
    and a later close() from another thread closes the tier."""
    tier = DiskTier(config(tmp_path, fingerprint=None))
    tier.write_slots(tier.store_buffers[0], ids(0)).result(WAIT_S)  # the thread runs
    refused: list[str] = []

    def close_on_the_io_thread() -> None:
        tier.close()
        try:
            tier.write_slots(tier.store_buffers[0], ids(1))
        except RuntimeError as exc:
            refused.append(str(exc))

    monkeypatch.setattr(threading, "Thread", _UnstartableThread)
    with caplog.at_level("WARNING", logger="kvtier.storage.disk_tier"):
        tier._store_io.submit(close_on_the_io_thread).result(WAIT_S)
    monkeypatch.undo()
    assert "cannot close it from its own I/O thread" in caplog.text
    assert refused == [f"disk tier {tier.path} is closed"]
    tier.close()
    assert not os.path.exists(tier.path)


class _GatedReads:
    """Real I/O, but each read first sets `reading` and waits for `release`."""

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.release = threading.Event()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        self.reading.set()
        if not self.release.wait(WAIT_S):
            raise OSError(errno.ETIMEDOUT, "the test never released the read")
        return os.preadv(fd, [into], offset)


def test_close_waits_for_a_queued_read(tmp_path: Path) -> None:
    """A read queued before close() is finished before the file is closed: closing the
    descriptor under it would fail it, or let it read another file that reused the
    descriptor's number."""
    io = _GatedReads()
    tier = DiskTier(config(tmp_path, fingerprint=None), io)
    tier.store_buffers[0].tensor[:1] = 5
    tier.write_slots(tier.store_buffers[0], ids(3)).result(WAIT_S)
    read = tier.read_slots(tier.load_buffers[0], ids(3))
    assert io.reading.wait(WAIT_S)
    closer = start_until_parked(tier.close, "closer")
    assert closer.is_alive()  # waiting for the read
    io.release.set()
    read.result()
    assert bool((tier.load_buffers[0].tensor[0] == 5).all())
    join_all(closer)
    assert not os.path.exists(tier.path)


@pytest.mark.parametrize("fingerprint", [None, "fp"])
def test_a_closed_tier_is_collected_without_a_warning(
    tmp_path: Path, fingerprint: str | None
) -> None:
    """Its finalizer is detached by close(): collection neither warns that the tier was
    not closed nor touches its files again."""
    tier = DiskTier(config(tmp_path, fingerprint))
    tier.write_slots(tier.store_buffers[0], ids(0), [SlotRecord(b"a", 1)]).result(WAIT_S)
    tier.close()
    path = tier.path
    gc.collect()  # earlier tests' garbage (a tier whose close was interrupted) warns here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del tier
        gc.collect()
    resource = [str(w.message) for w in caught if w.category is ResourceWarning]
    assert [message for message in resource if path in message] == []


def test_a_store_never_waits_behind_a_load(tmp_path: Path) -> None:
    """Reads and writes run on I/O threads of their own: a write completes while a read
    is still held in the disk (as a load never waits behind a queue of stores)."""
    io = _GatedReads()
    tier = DiskTier(config(tmp_path, fingerprint=None), io)
    try:
        tier.store_buffers[0].tensor[:1] = 5
        tier.write_slots(tier.store_buffers[0], ids(0)).result(WAIT_S)
        read = tier.read_slots(tier.load_buffers[0], ids(0))
        assert io.reading.wait(WAIT_S)
        tier.store_buffers[1].tensor[:1] = 6
        tier.write_slots(tier.store_buffers[1], ids(1)).result(WAIT_S)  # not behind the read
        io.release.set()
        read.result()
        assert bool((tier.load_buffers[0].tensor[0] == 5).all())
    finally:
        io.release.set()
        tier.close()


def test_a_second_end_persistence_is_a_no_op(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(config(tmp_path))
    try:
        with caplog.at_level("INFO", logger="kvtier.storage.disk_tier_records"):
            tier.end_persistence()
            assert len(caplog.records) == 1  # the first one ends it, and says so
            tier.end_persistence()
        assert len(caplog.records) == 1
    finally:
        tier.close()


def test_a_bad_slot_whose_records_cannot_be_dropped_still_raises_its_read_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A checksum mismatch found while the disk refuses both the tombstone and the
    manifest's rewrite and removal: the read raises BadSlotsError naming the slot (the
    caller's fallback is to recompute), the manifest's failure is logged, not raised in
    its place."""
    tier = DiskTier(config(tmp_path))
    tier.store_buffers[0].tensor[:1] = 9
    tier.write_slots(tier.store_buffers[0], ids(4), [SlotRecord(b"a", 1)]).result(WAIT_S)
    with open(tier.path, "r+b") as raw:
        raw.seek(4 * SLOT + 9)
        raw.write(b"\x00")

    def refuse(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    read = tier.read_slots(tier.load_buffers[0], ids(4))
    with monkeypatch.context() as patch, caplog.at_level("ERROR"):
        patch.setattr(os, "write", refuse)
        patch.setattr(os, "unlink", refuse)
        with pytest.raises(BadSlotsError) as caught:
            read.result()
    assert caught.value.slots == (4,)
    assert "cannot drop the manifest's records" in caplog.text
    assert "nor remove it" in caplog.text
    tier.close()


def test_a_recovered_slot_queued_for_a_write_is_no_longer_listed(tmp_path: Path) -> None:
    """Once a write of a recovered slot is queued its bytes are not the record's any more:
    a restore from the list would serve them under the old key."""
    tier = DiskTier(config(tmp_path))
    tier.store_buffers[0].tensor[:2] = 1
    tier.write_slots(tier.store_buffers[0], ids(2, 3), [SlotRecord(b"a", 1)] * 2).result()
    tier.close()
    tier = DiskTier(config(tmp_path))
    try:
        assert [slot for slot, _ in tier.recovered_slots()] == [2, 3]
        tier.store_buffers[0].tensor[:1] = 2
        tier.write_slots(tier.store_buffers[0], ids(3)).result(WAIT_S)
        assert [slot for slot, _ in tier.recovered_slots()] == [2]
    finally:
        tier.close()


def test_a_write_to_free_slots_syncs_no_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is synced before a batch only for the tombstones it must make durable
    (slots that held records); the put records appended by earlier commits are not synced
    as they go (a crash may lose them: a miss, never wrong bytes)."""
    tier = DiskTier(config(tmp_path))
    try:
        tier.store_buffers[0].tensor[:2] = 3
        tier.write_slots(tier.store_buffers[0], ids(0, 1), [SlotRecord(b"a", 1)] * 2).result()
        fsyncs: list[int] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            fsyncs.append(fd)
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        tier.write_slots(tier.store_buffers[0], ids(4, 5), [SlotRecord(b"b", 1)] * 2).result()
        assert fsyncs == []
        tier.write_slots(tier.store_buffers[0], ids(0), [SlotRecord(b"c", 1)]).result()
        assert len(fsyncs) == 1  # slot 0's tombstone, before its new bytes
    finally:
        monkeypatch.undo()
        tier.close()


def test_when_both_syncs_fail_at_close_the_slot_files_failure_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The slot file's sync failed first (its data may not be on the device): that is
    the error logged with the manifest's removal, not the manifest's later one."""
    tier = DiskTier(config(tmp_path))
    tier.write_slots(tier.store_buffers[0], ids(3), [SlotRecord(b"a", 1)]).result(WAIT_S)

    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # the directory's sync (the removal) works
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with caplog.at_level("ERROR"):
        tier.close()
    monkeypatch.undo()
    (logged,) = caplog.records
    assert logged.getMessage().startswith(
        f"[Errno 5] cannot sync the disk tier file: Input/output error: '{tier.path}'; "
        "removed the manifest"
    )


def test_a_persistent_tier_reopened_with_another_region_layout_restores_nothing(
    tmp_path: Path,
) -> None:
    """The same slot bytes cut into other regions (K and V swapped, say) would put each
    region's bytes where another one goes: the layout is part of the tier's identity."""
    first = dataclasses.replace(config(tmp_path), region_layout="k:2048;v:2048")
    tier = DiskTier(first)
    tier.write_slots(tier.store_buffers[0], ids(1), [SlotRecord(b"a", 1)]).result(WAIT_S)
    tier.close()
    tier = DiskTier(first)
    assert [slot for slot, _ in tier.recovered_slots()] == [1]
    tier.close()
    tier = DiskTier(dataclasses.replace(first, region_layout="v:2048;k:2048"))
    try:
        assert tier.recovered_slots() == []
    finally:
        tier.close()


def test_a_staging_buffer_holds_no_more_slots_than_the_tier(tmp_path: Path) -> None:
    small = DiskTierConfig(str(tmp_path / "rank0.slots"), 2, SLOT, batch_bytes=8 * SLOT)
    assert small.batch_slots == 2
    assert dataclasses.replace(small, batch_bytes=SLOT // 2).batch_slots == 1
