"""A persistent disk tier after an operating-system crash (power loss): the slot file may
hold every byte written to it, but the manifest holds only what was synced (see
`disk_tier_records`). A restart must then miss a block cleanly, never offer a record
that describes other bytes (a failed load) or a copy the scheduler let go.

The crash image and the helpers are in `crash_image`.
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
from crash_image import CrashImage, crash_after_next_data_write, persisted, restart_reads, write
from test_manifest_durability import rec

from kvtier.storage.slot_file import BadSlotsError, SlotFile

pytestmark = pytest.mark.timeout(60)


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
