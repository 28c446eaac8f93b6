"""`ManifestLog.sync` and `close` on their own: the records a sync counts durable are
those appended before its fsync began (one appended by another thread while the fsync
runs, outside the append lock, waits for the next call), and a compaction's failed fsync
fails sync() and close() only until `end()` rewrote the file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.storage import ManifestIdentity, manifest_log
from kvtier.storage.manifest import read_manifest
from kvtier.storage.manifest_log import ManifestLog

pytestmark = pytest.mark.timeout(60)

IDENTITY = ManifestIdentity("model-a|kv|sha256:0", 4, 4096, "kv[0]:4096")


def rec(i: int) -> SlotRecord:
    return SlotRecord(int(i).to_bytes(4, "little") * 9, 4)


def test_a_record_appended_during_the_fsync_is_synced_by_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = ManifestLog(str(tmp_path / "m.manifest"), IDENTITY.encode(), {})
    log.put([1], [1], [rec(1)])
    real_fsync = os.fsync
    fsyncs: list[int] = []

    def fsync_appending(fd: int) -> None:
        fsyncs.append(fd)
        if len(fsyncs) == 1:  # another thread's append lands while the fsync runs
            log.put([2], [2], [rec(2)])
        real_fsync(fd)

    monkeypatch.setattr(manifest_log.os, "fsync", fsync_appending)
    assert log.sync()
    assert log.sync()  # slot 2's record: appended after the first fsync began
    assert (len(fsyncs), log.syncs) == (2, 2)
    assert log.sync()  # nothing appended since
    assert len(fsyncs) == 2
    monkeypatch.undo()
    log.close()


def test_a_reset_after_a_compaction_s_failed_fsync_closes_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction's fsync of the old log's tombstones failed: sync() fails from then on,
    since those tombstones may be lost. `end()` then rewrites the file with no record
    (fsynced), so nothing it described is left to lose and close() succeeds."""
    path = str(tmp_path / "m.manifest")
    log = ManifestLog(path, IDENTITY.encode(), {}, compact_floor=4)
    log.put([1, 2], [1, 2], [rec(1), rec(2)])
    assert log.forget([1])  # a tombstone not synced yet
    real_fsync = os.fsync
    failures = [OSError(errno.EIO, "Input/output error")]

    def fsync_failing_once(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fsync(fd)

    monkeypatch.setattr(manifest_log.os, "fsync", fsync_failing_once)
    log.put([2, 2], [2, 2], [rec(2), rec(2)])  # 5 records, 1 live: a compaction is due
    assert not failures  # the compaction's fsync failed
    assert log.compactions == 0
    assert not log.sync()
    log.end()
    log.close()
    monkeypatch.undo()
    assert read_manifest(path, IDENTITY) == {}
