"""A persistent tier reopened with another number of slots (`disk_bytes` changed).

The live slots below the new end are kept; the slot file is resized only after the
manifest was rewritten for the new size, so a failed rewrite leaves both files as they
were, and after a failed resize the next open at either size keeps the cache.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest
from test_manifest import IDENTITY, close, open_tier_files, rec

from kvtier.storage import manifest_log
from kvtier.storage.slot_file import SlotFile


def first_run(tmp_path: Path) -> None:
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1, 6], [11, 66], [rec(1), rec(6)])
    close(slot_file, log)


def test_a_failed_manifest_rewrite_leaves_both_files_for_a_later_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_run(tmp_path)
    size = (tmp_path / "kvtier-rank0.slots").stat().st_size

    def full_disk(path: str, content: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(manifest_log, "rewrite_manifest", full_disk)
    smaller = dataclasses.replace(IDENTITY, num_slots=4)
    with pytest.raises(OSError, match="No space left"):
        open_tier_files(tmp_path, smaller)
    monkeypatch.undo()
    assert (tmp_path / "kvtier-rank0.slots").stat().st_size == size  # not resized
    slot_file, log, live = open_tier_files(tmp_path, smaller)  # room again: resized now
    assert live == {1: (11, rec(1))}
    assert slot_file.file_size() == 4 * IDENTITY.bytes_per_slot
    close(slot_file, log)


@pytest.mark.parametrize("retry_slots", [8, 16], ids=["old size", "new size"])
def test_after_a_failed_resize_either_size_keeps_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retry_slots: int
) -> None:
    """Regression (review): a grow that failed for lack of space left a manifest for 16
    slots beside a file of 8, and the next open discarded both at either size, though
    the advice was to lower disk_bytes or free space."""
    first_run(tmp_path)

    def no_room(self: SlotFile) -> None:
        raise OSError(errno.ENOSPC, "cannot resize the disk tier file", self.path)

    monkeypatch.setattr(SlotFile, "resize", no_room)
    with pytest.raises(OSError, match="cannot resize"):
        open_tier_files(tmp_path, dataclasses.replace(IDENTITY, num_slots=16))
    monkeypatch.undo()
    retry = dataclasses.replace(IDENTITY, num_slots=retry_slots)
    slot_file, log, live = open_tier_files(tmp_path, retry)
    assert live == {1: (11, rec(1)), 6: (66, rec(6))}
    assert slot_file.reused
    assert os.path.getsize(slot_file.path) == retry_slots * IDENTITY.bytes_per_slot
    close(slot_file, log)
