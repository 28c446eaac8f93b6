"""`PendingPuts` on its own: a group's age counts from its oldest pending record
(`COMMIT_SECONDS`), so records added one after another while writes stay queued (a busy
store queue) do not keep pushing the commit back, which would leave every record of a
steady stream of stores unsynced, lost to a crash, for as long as the stream lasts; and
a failed sync tombstones the older records of the group's slots (or, when it
cannot, fails the commit)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_group_commit import _put
from test_manifest_durability import rec

from kvtier.storage import manifest_log, pending_puts
from kvtier.storage.manifest_log import ManifestLog
from kvtier.storage.pending_puts import PendingPuts


def test_a_group_is_due_once_its_oldest_record_waited_commit_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(pending_puts.time, "monotonic", lambda: now[0])
    log = ManifestLog(str(tmp_path / "m.manifest"), b"header", {})
    pending = PendingPuts(log, lambda: None, bytes_per_slot=4096, commit_seconds=1.0)
    for _ in range(4):
        pending.queued()  # the queue never empties while the records are added
    pending.add([1], [1], [rec(1)])
    now[0] = 100.6
    assert not pending.write_done()  # 0.6 s old, writes still queued
    pending.add([2], [2], [rec(2)])
    now[0] = 101.2
    assert pending.write_done()  # slot 1's record waited 1.2 s (slot 2's only 0.6 s)
    assert pending.commit()
    assert len(pending) == 0
    now[0] = 105.0
    pending.add([3], [3], [rec(3)])  # a new group: its age starts now, not at 100.0
    now[0] = 105.5
    assert not pending.write_done()
    log.close()


def test_a_failed_sync_tombstones_the_older_records_of_the_groups_slots(
    tmp_path: Path,
) -> None:
    """`PendingPuts.commit` on its own (the tier's `prepare_overwrite` usually tombstoned
    the older record already): after a failed sync the slot's bytes are unknown, so
    neither its new record nor its older one may stay in the manifest."""
    log, pending = _slot_1_rewritten_under_a_failing_sync(tmp_path, slots=[1, 2])
    assert pending.commit()  # the tombstone was appended: persistence goes on
    assert len(pending) == 0
    assert log._live == {2: _put(2, 2, rec(2))}
    log.close()


def test_a_failed_sync_whose_tombstones_cannot_be_appended_fails_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot's older record stays in the manifest over bytes of unknown state: the
    commit returns False and the tier ends persistence for the run."""
    log, pending = _slot_1_rewritten_under_a_failing_sync(tmp_path, slots=[1])

    def failing_write(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest_log.os, "write", failing_write)
    assert not pending.commit()
    monkeypatch.undo()
    assert len(pending) == 0
    assert log._live == {1: _put(1, 1, rec(1))}
    log.close()


def test_a_group_after_clear_ages_from_its_own_first_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(pending_puts.time, "monotonic", lambda: now[0])
    log = ManifestLog(str(tmp_path / "m.manifest"), b"header", {})
    pending = PendingPuts(log, lambda: None, bytes_per_slot=4096, commit_seconds=1.0)
    pending.queued()
    pending.queued()
    pending.add([1], [1], [rec(1)])
    pending.clear()  # persistence ended: the records are dropped
    now[0] = 105.0
    pending.add([2], [2], [rec(2)])
    now[0] = 105.5
    assert not pending.write_done()  # 0.5 s old, a write still queued
    log.close()


def _slot_1_rewritten_under_a_failing_sync(
    tmp_path: Path, slots: list[int]
) -> tuple[ManifestLog, PendingPuts]:
    """Return a manifest holding a record per slot of `slots` (slot n: record n) and a
    group that rewrote slot 1 (record 9) and whose sync will fail, not yet committed."""
    log = ManifestLog(str(tmp_path / "m.manifest"), b"header", {})
    log.put(slots, slots, [rec(slot) for slot in slots])

    def failing_sync() -> None:
        raise OSError(5, "Input/output error")

    pending = PendingPuts(log, failing_sync, bytes_per_slot=4096)
    pending.add([1], [9], [rec(9)])
    return log, pending
