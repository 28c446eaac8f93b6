"""A persistent disk tier's manifest compaction after a crash: a compaction whose
directory sync fails may lose its rename, or keep tombstones whose fsync failed; a
restart must still offer no copy `forget` let go (see `test_disk_tier_crash`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from crash_image import CrashImage, persisted, restart_reads
from test_manifest_durability import rec, tier_config

from kvtier.storage import DiskTier
from kvtier.storage import disk_tier as disk_tier_module

pytestmark = pytest.mark.timeout(60)


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
