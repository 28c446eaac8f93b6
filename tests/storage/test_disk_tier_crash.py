"""A persistent disk tier after an operating-system crash (power loss): the slot file may
hold every byte written to it, but the manifest holds only what was synced (see
`disk_tier_records`). A restart must then miss a block cleanly, never offer a record
that describes other bytes (a failed load) or a copy the scheduler let go.

`CrashImage` keeps the manifest's bytes as of its last fsync and, at the crash, the slot
file as it is (the page cache may have written back any write); `restore` puts that
image in place of the files, as the device would hold them after the power came back.
Which file the manifest's name stands for is durable only once its directory is synced
too: a rename or a removal not followed by a directory fsync may be undone by the crash
(the image then holds the file the name stood for at the last directory fsync, as last
synced).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_manifest_durability import rec, tier_config

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskTier
from kvtier.storage import disk_tier as disk_tier_module
from kvtier.storage.slot_file import BadSlotsError, SlotFile

pytestmark = pytest.mark.timeout(60)


class CrashImage:
    """The files of the tier in `directory` as a crash now would leave them on the device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
        self._directory = directory
        self._slots = directory / "rank0.slots"
        self._manifest = directory / "rank0.manifest"
        names = {str(self._manifest), f"{self._manifest}.tmp"}
        # The synced bytes of each manifest file (by inode), and the inode the manifest's
        # name durably stands for (None: durably removed); the open rewrote and synced it.
        self._synced = {self._manifest.stat().st_ino: self._manifest.read_bytes()}
        self._named: int | None = self._manifest.stat().st_ino
        self.image: tuple[bytes, bytes | None] | None = None
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            real_fsync(fd)
            target = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
            if target == str(directory):
                self._named = self._manifest.stat().st_ino if self._manifest.exists() else None
            elif target in names:
                with open(f"/proc/self/fd/{fd}", "rb") as file:
                    self._synced[os.fstat(fd).st_ino] = file.read()

        monkeypatch.setattr(os, "fsync", fsync)

    @property
    def synced(self) -> bytes | None:
        """The manifest a crash now would leave (None: no manifest)."""
        return None if self._named is None else self._synced[self._named]

    def take(self) -> None:
        """Crash now: the slot file as written so far, the manifest as last synced."""
        self.image = (self._slots.read_bytes(), self.synced)

    def restore(self) -> None:
        """Replace the (closed) tier's files by the image taken at the crash."""
        assert self.image is not None, "no crash was taken"
        slots, manifest = self.image
        self._slots.write_bytes(slots)
        if manifest is None:
            self._manifest.unlink(missing_ok=True)
        else:
            self._manifest.write_bytes(manifest)


def crash_after_next_data_write(monkeypatch: pytest.MonkeyPatch, crash: CrashImage) -> None:
    """Take the crash image right after the tier's next slot write: the data has landed,
    its put record waits for the group commit."""
    real = SlotFile.write

    def write(slot_file: SlotFile, data: memoryview, first_slot: int) -> None:
        real(slot_file, data, first_slot)
        if crash.image is None:
            crash.take()

    monkeypatch.setattr(SlotFile, "write", write)


def write(tier: DiskTier, slot: int, record: SlotRecord, fill: int) -> None:
    buffer = tier.store_buffers[0]
    buffer.tensor[0].fill_(fill)
    tier.write_slots(buffer, np.array([slot], dtype=np.int64), [record]).result()


def restart_reads(tmp_path: Path) -> list[tuple[int, SlotRecord]]:
    """Open the tier on the crashed files; return what it recovered after checking that
    every recovered slot loads (a record describing other bytes fails its checksum)."""
    tier = DiskTier(tier_config(tmp_path))
    try:
        recovered = tier.recovered_slots()
        buffer = tier.load_buffers[0]
        for slot, _ in recovered:
            tier.read_slots(buffer, np.array([slot], dtype=np.int64)).result()
        return recovered
    finally:
        tier.close()


def persisted(tmp_path: Path, records: dict[int, int]) -> DiskTier:
    """Write slot -> record number (bytes filled with it), close, and reopen the tier:
    every record is durable and recovered."""
    tier = DiskTier(tier_config(tmp_path))
    for slot, number in records.items():
        write(tier, slot, rec(number), number)
    tier.close()
    tier = DiskTier(tier_config(tmp_path))
    assert tier.recovered_slots() == [(slot, rec(n)) for slot, n in sorted(records.items())]
    return tier


@pytest.mark.parametrize("prepared", [False, True])
def test_a_slot_reused_for_another_block_is_a_clean_miss_after_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prepared: bool
) -> None:
    """The block of slot 1 was evicted and the slot reused for another key (a write with
    records, no `forget`; or, `prepared`, a job that tombstoned its slots first): its old
    record must be durably dropped before the new bytes can land, or a crash before the
    new record's commit leaves the old record over them, and the restart's load fails."""
    tier = persisted(tmp_path, {1: 1, 2: 2})
    crash = CrashImage(monkeypatch, tmp_path)
    crash_after_next_data_write(monkeypatch, crash)
    if prepared:
        tier.prepare_overwrite([1, 3])
    write(tier, 1, rec(7), 7)
    tier.close()
    monkeypatch.undo()
    crash.restore()
    assert restart_reads(tmp_path) == [(2, rec(2))]


def test_a_forgotten_copy_is_not_restored_after_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`forget` names copies the scheduler let go (maybe suspect: their bytes match
    their checksum): once it returns, no crash may bring them back."""
    tier = persisted(tmp_path, {1: 1, 2: 2})
    crash = CrashImage(monkeypatch, tmp_path)
    tier.forget([1])
    crash.take()
    tier.close()
    monkeypatch.undo()
    crash.restore()
    assert restart_reads(tmp_path) == [(2, rec(2))]


def test_a_forget_on_a_full_disk_removes_the_manifest_durably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk is full: `forget` can neither append its tombstone nor empty the manifest,
    so it removes the manifest; once it returns, no crash may bring the file back, with
    the forgotten copy's record."""
    tier = persisted(tmp_path, {1: 1, 2: 2})
    crash = CrashImage(monkeypatch, tmp_path)

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "no space left on device")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(os, "write", full)  # the manifest's appends and rewrites
        tier.forget([1])
    assert "removed it" in caplog.text
    crash.take()
    tier.close()
    monkeypatch.undo()
    crash.restore()
    assert restart_reads(tmp_path) == []


def test_a_manifest_left_for_the_close_to_remove_is_removed_durably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`forget` could neither empty nor remove the manifest (it raises): the close
    removes it, and no crash after the close may bring it back."""
    tier = persisted(tmp_path, {1: 1, 2: 2})
    crash = CrashImage(monkeypatch, tmp_path)

    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EACCES, "permission denied")

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", refused)  # the manifest's appends and rewrites
        patch.setattr(os, "unlink", refused)
        with pytest.raises(OSError, match="nor remove it"):
            tier.forget([1])
    tier.close()
    crash.take()
    monkeypatch.undo()
    crash.restore()
    assert restart_reads(tmp_path) == []


def reopened_compacting_early(
    tier: DiskTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> DiskTier:
    """Close `tier` and open it again with a manifest that compacts from 8 records on."""
    tier.close()
    real_open = disk_tier_module.open_manifest
    monkeypatch.setattr(disk_tier_module, "open_manifest", lambda f, i: real_open(f, i, 8))
    return DiskTier(tier_config(tmp_path))


def test_a_compaction_whose_rename_a_crash_undoes_keeps_the_tombstones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`forget`'s tombstones set off a compaction whose directory cannot be synced: the
    rename may be lost in a crash, and the old log come back. It must then hold the
    tombstones, or the copies `forget` let go are restored."""
    tier = persisted(tmp_path, {slot: slot for slot in range(1, 7)})
    tier = reopened_compacting_early(tier, tmp_path, monkeypatch)
    crash = CrashImage(monkeypatch, tmp_path)
    tracked = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path):
            raise OSError(errno.EIO, "Input/output error")
        tracked(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tier.forget([1, 2, 3, 4, 5])  # 11 records for 1 live slot: compacted
    assert tier._records.log is not None
    assert tier._records.log.compactions == 1
    crash.take()
    tier.close()
    monkeypatch.undo()
    crash.restore()
    assert restart_reads(tmp_path) == [(6, rec(6))]


def fail_next_directory_syncs(monkeypatch: pytest.MonkeyPatch, directory: Path, count: int) -> None:
    """Make the next `count` fsyncs of `directory` fail with EIO (a transient error)."""
    tracked = os.fsync
    failures = [count]

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(directory) and failures[0] > 0:
            failures[0] -= 1
            raise OSError(errno.EIO, "Input/output error")
        tracked(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("then", ["forget", "close"])
def test_a_tombstone_after_a_compaction_whose_directory_sync_failed_survives_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """Regression: a compaction's directory sync failed once (only logged), so a crash
    may undo its rename and bring the old log back. A tombstone appended to the new
    log after it, synced by `forget` (or the close), was lost with the rename: the old
    log restored the copy `forget` let go. The rename must be made durable before such
    a tombstone counts as synced."""
    tier = persisted(tmp_path, {slot: slot for slot in range(1, 8)})
    tier = reopened_compacting_early(tier, tmp_path, monkeypatch)
    crash = CrashImage(monkeypatch, tmp_path)
    fail_next_directory_syncs(monkeypatch, tmp_path, 1)
    tier.forget([1, 2, 3, 4, 5])  # 12 records for 2 live slots: compacted
    assert tier._records.log is not None
    assert tier._records.log.compactions == 1
    if then == "forget":
        tier.forget([6])
        crash.take()
        tier.close()
    else:
        tier._records.log.forget([6])  # an overwrite's tombstone: synced by the close
        tier.close()
        crash.take()
    monkeypatch.undo()
    crash.restore()
    assert restart_reads(tmp_path) == [(7, rec(7))]


def test_tombstones_whose_fsync_failed_in_a_compaction_are_never_taken_for_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the fsync of `forget`'s tombstones before a compaction failed (the
    compaction was only logged as failed). Linux reports a failed writeback once and
    may drop the pages, so `forget`'s own fsync then succeeded although the tombstones
    never reached the device: a crash restored the copies `forget` let go. A failed
    fsync must end persistence, as one in `sync()` does."""
    tier = persisted(tmp_path, {slot: slot for slot in range(1, 8)})
    tier = reopened_compacting_early(tier, tmp_path, monkeypatch)
    crash = CrashImage(monkeypatch, tmp_path)
    manifest = tmp_path / "rank0.manifest"
    tracked = os.fsync
    lost: list[tuple[int, bytes]] = []  # synced bytes and the content when the fsync failed

    def fsync(fd: int) -> None:
        if not lost and os.readlink(f"/proc/self/fd/{fd}") == str(manifest):
            synced = crash.synced
            assert synced is not None
            lost.append((len(synced), manifest.read_bytes()))
            raise OSError(errno.EIO, "Input/output error")
        tracked(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tier.forget([1, 2, 3, 4, 5])  # 12 records for 2 live slots: compaction due
    assert lost, "the compaction did not sync the tombstones"
    crash.take()
    tier.close()
    monkeypatch.undo()
    assert crash.image is not None
    slots, image = crash.image
    start, failed = lost[0]
    if image is not None and image.startswith(failed):  # the pages the failure dropped
        image = image[:start] + bytes(len(failed) - start) + image[len(failed) :]
    crash.image = (slots, image)
    crash.restore()
    assert {slot for slot, _ in restart_reads(tmp_path)} <= {6, 7}


def test_a_pending_record_of_a_forgotten_slot_never_describes_later_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record still pending when its slot is forgotten is dropped: neither the
    slot's rewrite without records, nor one with records, nor the close appends it."""
    tier = persisted(tmp_path, {2: 2})
    gate = _HoldCommits(monkeypatch)
    write(tier, 1, rec(1), 1)  # pending: the commit is held
    tier.forget([1])
    write(tier, 1, rec(5), 5)
    buffer = tier.store_buffers[0]
    buffer.tensor[0].fill_(6)
    tier.write_slots(buffer, np.array([3], dtype=np.int64), [rec(6)]).result()
    tier.forget([3])
    buffer.tensor[0].fill_(9)
    tier.write_slots(buffer, np.array([3], dtype=np.int64), None).result()
    gate.release()
    tier.check_invariants()
    tier.close()
    assert restart_reads(tmp_path) == [(1, rec(5)), (2, rec(2))]


class _HoldCommits:
    """Keep the tier's group commits from running until `release` (they then run at
    the close): every put record stays pending meanwhile."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvtier.storage.disk_tier_records import DiskRecords

        self._held = True
        real: Callable[[Any], None] = DiskRecords.commit

        def commit(records: DiskRecords) -> None:
            if not self._held:
                real(records)

        monkeypatch.setattr(DiskRecords, "commit", commit)

    def release(self) -> None:
        self._held = False


def test_a_checksum_mismatch_that_cannot_be_recorded_drops_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A slot that failed its checksum is tombstoned; when the tombstone cannot be
    appended, its record would fail again after a restart: every record goes, and
    nothing more is persisted in this run, as when `forget` cannot append."""
    tier = persisted(tmp_path, {1: 1, 2: 2})
    with open(tmp_path / "rank0.slots", "r+b") as file:  # the device damaged slot 1
        file.seek(1 * 4096 + 10)
        file.write(b"\xff")

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "no space left on device")

    read = tier.read_slots(tier.load_buffers[0], np.array([1], dtype=np.int64))
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(os, "write", full)  # the manifest's appends; slot data uses pwrite
        with pytest.raises(BadSlotsError, match="checksum mismatch in slot 1"):
            read.result()
    assert "dropped every record" in caplog.text
    tier.check_invariants()
    write(tier, 3, rec(3), 3)  # not recorded any more
    tier.close()
    assert restart_reads(tmp_path) == []


def test_any_part_of_the_manifest_written_since_its_last_sync_may_survive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash keeps the manifest as last synced plus any part of what was appended
    since: a prefix (a record cut short), or later pages without earlier ones (zeros
    in their place). Whichever part survives, a restart offers no copy `forget` let go
    and no record over other bytes: every slot it recovers loads."""
    tier = persisted(tmp_path, {1: 1, 2: 2})
    crash = CrashImage(monkeypatch, tmp_path)
    tier.forget([2])  # synced
    write(tier, 1, rec(7), 7)  # slot 1 reused: its tombstone synced, then the new put
    write(tier, 3, rec(3), 3)  # appended at its commit, not synced
    crash.take()
    assert crash.image is not None
    slots, synced = crash.image
    assert synced is not None
    manifest = tmp_path / "rank0.manifest"
    appended = manifest.read_bytes()
    assert appended.startswith(synced)
    assert len(appended) > len(synced)
    tier.close()
    monkeypatch.undo()
    tail = len(appended) - len(synced)
    for kept in range(tail + 1):
        lost = tail - kept
        for image in (
            appended[: len(synced) + kept],
            synced + bytes(lost) + appended[len(appended) - kept :],
        ):
            (tmp_path / "rank0.slots").write_bytes(slots)
            manifest.write_bytes(image)
            recovered = set(restart_reads(tmp_path))
            assert recovered <= {(1, rec(7)), (3, rec(3))}, (kept, recovered)


def test_a_crash_at_any_step_of_a_store_over_recorded_slots_offers_no_wrong_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after any write or sync of a `forget` and of a job reusing recorded
    slots (tombstones up front, two batches): with the manifest as last synced, or with
    everything appended (a killed process), every recovered slot loads, and none that
    `forget` let go once it returned."""
    tier = persisted(tmp_path, {1: 1, 2: 2, 4: 4, 5: 5})
    crash = CrashImage(monkeypatch, tmp_path)
    manifest = tmp_path / "rank0.manifest"
    steps: list[tuple[bytes, bytes | None, bytes, bool]] = []
    forgotten = False

    def step() -> None:
        crash.take()
        assert crash.image is not None
        steps.append((*crash.image, manifest.read_bytes(), forgotten))

    def after(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            result = real(*args)
            step()
            return result

        return call

    for name in ("write", "fsync", "fdatasync"):
        monkeypatch.setattr(os, name, after(getattr(os, name)))
    monkeypatch.setattr(SlotFile, "write", after(SlotFile.write))
    tier.forget([4])
    forgotten = True
    tier.prepare_overwrite([1, 2, 3])
    buffer = tier.store_buffers[0]
    for slots, fill in (([1, 2], 7), ([3], 9)):
        buffer.tensor[: len(slots)].fill_(fill)
        records = [rec(fill + i) for i in range(len(slots))]
        tier.write_slots(buffer, np.array(slots, dtype=np.int64), records).result()
    tier.close()
    monkeypatch.undo()
    assert len(steps) > 8
    for slots, synced, appended, after_forget in steps:
        for image in (synced, appended):
            (tmp_path / "rank0.slots").write_bytes(slots)
            manifest.write_bytes(image if image is not None else b"")
            if image is None:
                manifest.unlink()
            recovered = dict(restart_reads(tmp_path))  # every recovered slot loads
            assert not (after_forget and 4 in recovered), "a forgotten copy came back"
