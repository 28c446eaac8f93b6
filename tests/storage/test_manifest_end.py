"""`ManifestLog.end` (a tier reset): every record dropped on disk at once, none appended
afterwards, and a failure to drop them never leaves them for the next open."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
from test_manifest import IDENTITY, close, manifest_of, open_tier_files, rec

from kvtier.storage import manifest_compaction, manifest_log
from kvtier.storage.disk_tier_close import close_files
from kvtier.storage.manifest import read_manifest

pytestmark = pytest.mark.timeout(60)


def first_log(tmp_path: Path) -> None:
    """Leave a manifest with records for slots 1..3."""
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {}
    log.put([1, 2, 3], [11, 12, 13], [rec(1), rec(2), rec(3)])
    close(slot_file, log)


def test_end_empties_the_file_at_once_and_appends_nothing_more(tmp_path: Path) -> None:
    first_log(tmp_path)
    slot_file, log, live = open_tier_files(tmp_path)
    assert sorted(live) == [1, 2, 3]
    log.put([4], [14], [rec(4)])
    log.end()
    assert log.ended
    # What a crash now leaves (the rewrite is fsynced and renamed into place).
    assert read_manifest(str(manifest_of(tmp_path)), IDENTITY) == {}
    log.put([5], [15], [rec(5)])  # a write in flight at the reset, or one after it
    assert log.forget([1])  # no record of slot 1 is left to tombstone
    log.end()  # idempotent
    assert read_manifest(str(manifest_of(tmp_path)), IDENTITY) == {}
    close(slot_file, log)
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {}
    log.put([6], [16], [rec(6)])  # a run without a reset records again
    close(slot_file, log)
    assert sorted(read_manifest(str(manifest_of(tmp_path)), IDENTITY)) == [6]


def test_a_failed_rewrite_removes_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first_log(tmp_path)
    slot_file, log, _ = open_tier_files(tmp_path)

    def full_disk(path: str, content: bytes, durable_rename: bool = False) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(manifest_log, "rewrite_manifest", full_disk)
    with caplog.at_level(logging.WARNING):
        log.end()
    assert "cannot empty it" in caplog.text
    assert not manifest_of(tmp_path).exists()
    log.put([4], [14], [rec(4)])
    close(slot_file, log)
    assert not manifest_of(tmp_path).exists()
    monkeypatch.undo()
    slot_file, log, live = open_tier_files(tmp_path)  # discarded with a warning: empty
    assert live == {}
    close(slot_file, log)


def test_a_rewrite_whose_rename_cannot_be_made_durable_removes_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Until the directory is synced, a crash may undo the rename and bring back the
    records the reset dropped: the manifest is removed (and that removal synced) instead."""
    first_log(tmp_path)
    slot_file, log, _ = open_tier_files(tmp_path)
    real_sync = manifest_compaction.sync_directory
    calls = []

    def sync_failing_once(path: str) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error", path)
        real_sync(path)

    monkeypatch.setattr(manifest_compaction, "sync_directory", sync_failing_once)
    monkeypatch.setattr(manifest_log, "sync_directory", sync_failing_once)
    with caplog.at_level(logging.WARNING):
        log.end()
    assert "cannot sync the new manifest's directory" in caplog.text
    assert len(calls) == 2  # the rewrite's, then the removal's
    assert not manifest_of(tmp_path).exists()
    close(slot_file, log)
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {}
    close(slot_file, log)


def test_a_manifest_that_can_be_neither_emptied_nor_removed_is_removed_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first_log(tmp_path)
    slot_file, log, _ = open_tier_files(tmp_path)

    def refuse(path: str, content: bytes = b"", durable_rename: bool = False) -> int:
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(manifest_log, "rewrite_manifest", refuse)
    monkeypatch.setattr(manifest_log, "unlink_quietly", refuse)
    with pytest.raises(OSError, match="cannot drop the manifest's records"):
        log.end()
    log.put([4], [14], [rec(4)])  # nothing more is recorded all the same
    monkeypatch.undo()  # the tier's close can remove it now
    with caplog.at_level(logging.ERROR):
        close_files(slot_file, log)
    assert "could not be dropped at a reset" in caplog.text
    assert not manifest_of(tmp_path).exists()
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {}
    close(slot_file, log)
