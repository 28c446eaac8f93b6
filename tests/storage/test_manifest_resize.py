"""A persistent tier reopened with another number of slots (`disk_bytes` changed).

The live slots below the new end are kept; the slot file grows only after the manifest
was rewritten for the new size, so a failed rewrite leaves both files as they
were; a shrink goes before the rewrite (it frees space); after a failed or cut-short
resize the next open at either size keeps the slots that are still whole.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from pathlib import Path

import pytest
from test_disk_faults import open_paths
from test_manifest import IDENTITY, close, open_tier_files, rec

from kvtier.storage import manifest_log, slot_file_open
from kvtier.storage.slot_file import SlotFile


def first_run(tmp_path: Path) -> None:
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1, 6], [11, 66], [rec(1), rec(6)])
    close(slot_file, log)


def full_disk(path: str, content: bytes) -> int:
    raise OSError(errno.ENOSPC, "No space left on device", path)


def test_a_grow_waits_for_the_manifest_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed rewrite before a grow leaves both files as they were, for a later open."""
    first_run(tmp_path)
    size = (tmp_path / "kvtier-rank0.slots").stat().st_size
    monkeypatch.setattr(manifest_log, "rewrite_manifest", full_disk)
    larger = dataclasses.replace(IDENTITY, num_slots=16)
    with pytest.raises(OSError, match="No space left"):
        open_tier_files(tmp_path, larger)
    monkeypatch.undo()
    assert (tmp_path / "kvtier-rank0.slots").stat().st_size == size  # not resized
    slot_file, log, live = open_tier_files(tmp_path, larger)  # room again: resized now
    assert live == {1: (11, rec(1)), 6: (66, rec(6))}
    assert slot_file.file_size() == 16 * IDENTITY.bytes_per_slot
    close(slot_file, log)


def test_a_shrink_goes_before_the_manifest_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review): on a full disk the rewrite failed before the shrink that
    would have freed its space; the shrink comes first, and the old manifest beside the
    shrunk file keeps the slots that still fit."""
    first_run(tmp_path)
    monkeypatch.setattr(manifest_log, "rewrite_manifest", full_disk)
    smaller = dataclasses.replace(IDENTITY, num_slots=4)
    with pytest.raises(OSError, match="No space left"):
        open_tier_files(tmp_path, smaller)
    monkeypatch.undo()
    assert (tmp_path / "kvtier-rank0.slots").stat().st_size == 4 * IDENTITY.bytes_per_slot
    slot_file, log, live = open_tier_files(tmp_path, IDENTITY)  # even back at 8 slots
    assert live == {1: (11, rec(1))}
    assert slot_file.file_size() == 8 * IDENTITY.bytes_per_slot
    close(slot_file, log)


def test_a_file_cut_inside_a_slot_keeps_the_whole_slots_below_the_cut(tmp_path: Path) -> None:
    """Regression (review): a grow stopped by a full disk ends where the filesystem
    stopped, rarely at a slot boundary, and the whole cache was discarded."""
    first_run(tmp_path)
    os.truncate(tmp_path / "kvtier-rank0.slots", 6 * IDENTITY.bytes_per_slot + 100)
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (11, rec(1))}  # slot 6 was cut
    assert slot_file.file_size() == 8 * IDENTITY.bytes_per_slot
    close(slot_file, log)


def test_stray_bytes_past_the_last_slot_are_named_and_cut_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A slot file a part slot longer than its manifest's slots: every slot is kept, the
    open says what it found, and the tail is cut off."""
    first_run(tmp_path)
    size = 8 * IDENTITY.bytes_per_slot + 100
    os.truncate(tmp_path / "kvtier-rank0.slots", size)
    with caplog.at_level(logging.WARNING):
        slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (11, rec(1)), 6: (66, rec(6))}
    assert f"holds {size} B, its manifest" in caplog.text
    assert f"says 8 slots of {IDENTITY.bytes_per_slot} B" in caplog.text
    assert slot_file.file_size() == 8 * IDENTITY.bytes_per_slot
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


def test_a_failed_grow_gives_back_what_it_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review): on ext4 a failed fallocate keeps the blocks it got and the
    file's new size, so the disk stayed full and no later open could rewrite its
    manifest; the file is cut back to its size before the grow."""
    first_run(tmp_path)

    def partial(fd: int, nbytes: int) -> None:
        os.ftruncate(fd, nbytes - 1000)  # what the filesystem allocated before it ran out
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slot_file_open, "reserve", partial)
    with pytest.raises(OSError, match="disk_bytes; lower it or free space"):
        open_tier_files(tmp_path, dataclasses.replace(IDENTITY, num_slots=16))
    monkeypatch.undo()
    assert str(tmp_path / "kvtier-rank0.manifest") not in open_paths(tmp_path)  # closed
    assert (tmp_path / "kvtier-rank0.slots").stat().st_size == 8 * IDENTITY.bytes_per_slot
    slot_file, log, live = open_tier_files(tmp_path)  # lowered back: the cache is kept
    assert live == {1: (11, rec(1)), 6: (66, rec(6))}
    close(slot_file, log)


def test_a_discarded_slot_file_keeps_a_hard_linked_copy(tmp_path: Path) -> None:
    """Regression (review): giving back a discarded file's space emptied its inode, and
    with it a hard-linked backup (`cp -al`, `rsync --link-dest`)."""
    first_run(tmp_path)
    backup = tmp_path / "backup.slots"
    os.link(tmp_path / "kvtier-rank0.slots", backup)
    other = dataclasses.replace(IDENTITY, fingerprint="model-b|kv|sha256:0")
    slot_file, log, live = open_tier_files(tmp_path, other)  # discarded and recreated
    assert live == {}
    assert backup.stat().st_size == 8 * IDENTITY.bytes_per_slot
    close(slot_file, log)


@pytest.mark.parametrize("code", [errno.EPERM, errno.ENOSPC])
def test_a_failed_shrink_does_not_advise_lowering_disk_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Not even when it fails for want of space (a copy-on-write filesystem may need
    some to cut a file): the advice is for a grow only."""
    first_run(tmp_path)

    def refused(fd: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "ftruncate", refused)
    with pytest.raises(OSError, match="cannot shrink the disk tier file") as error:
        open_tier_files(tmp_path, dataclasses.replace(IDENTITY, num_slots=4))
    assert "lower it" not in str(error.value)
    del error  # its traceback holds the failed open's slot file, and so its lock
    monkeypatch.undo()
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (11, rec(1)), 6: (66, rec(6))}  # nothing was lost
    close(slot_file, log)


def test_running_out_of_descriptors_keeps_the_tier_for_a_later_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review): "Too many open files" opening the manifest discarded the
    tier; nothing is wrong with its files, so the open fails and keeps them."""
    first_run(tmp_path)
    real_open = os.open

    def no_descriptors(path: str, flags: int, *args: int, **kwargs: object) -> int:
        if str(path).endswith(".manifest"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_descriptors)
    with pytest.raises(OSError, match="cannot open the manifest: Too many open files"):
        open_tier_files(tmp_path)
    monkeypatch.undo()
    slot_file, log, live = open_tier_files(tmp_path)
    assert live == {1: (11, rec(1)), 6: (66, rec(6))}
    close(slot_file, log)
