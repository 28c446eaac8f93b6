"""Slot file edges: sizes that are not positive, part-slot buffers, a recreated persistent
file (locked, the old file's space given back before the new one is sized), opening under
the fork lock, a file's mode under any umask, stale or foreign files (or a symlink) at the
path, space allocated at open (with or without fallocate), and the fork list after close."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

import pytest
from storage_helpers import direct_io_dir, num_open_fds

from kvtier.storage import DiskIOMode, SlotFile, slot_file, slot_file_handles, slot_file_open
from kvtier.storage.file_lock import is_locked
from kvtier.storage.slot_file import DiskTierBusyError

SLOT = 4096

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("num_slots", "bytes_per_slot"), [(0, SLOT), (-1, SLOT), (2, 0)])
def test_sizes_that_are_not_positive_are_refused(
    tmp_path: Path, num_slots: int, bytes_per_slot: int
) -> None:
    """No slot file is made for no slots (every transfer would be out of range) or for
    0-byte slots (every transfer would divide by zero)."""
    path = tmp_path / "rank0.slots"
    with pytest.raises(ValueError, match="positive sizes"):
        SlotFile(str(path), num_slots, bytes_per_slot, DiskIOMode.PAGE_CACHE)
    assert not path.exists()


def test_a_recreated_file_holds_the_lock(tmp_path: Path) -> None:
    """The fresh file `recreate()` makes is locked: a second opener is refused as busy,
    as it was by the file it replaced; and it is no longer `reused`."""
    path = str(tmp_path / "rank0.slots")
    SlotFile(path, 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=True).close()
    slot_file = SlotFile(path, 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=True)
    assert slot_file.reused
    slot_file.recreate()
    assert not slot_file.reused
    assert is_locked(path)
    with pytest.raises(DiskTierBusyError, match="locked by another"):
        SlotFile(path, 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=True)
    slot_file.close()
    assert not is_locked(path)


def test_recreate_gives_back_the_old_files_space_before_sizing_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a nearly full disk the new file may need the old one's blocks: they are freed
    (the unlinked old file cut to 0 bytes) before the new file is sized, not when the old
    descriptor closes afterwards."""
    path = str(tmp_path / "rank0.slots")
    slot_file = SlotFile(path, 4, SLOT, DiskIOMode.PAGE_CACHE, persistent=True)
    old_fd = os.dup(slot_file._handle.fd)  # type: ignore[arg-type]
    seen: list[int] = []
    real_reserve = slot_file_open.reserve

    def reserve(fd: int, nbytes: int) -> None:
        seen.append(os.fstat(old_fd).st_size)
        real_reserve(fd, nbytes)

    monkeypatch.setattr(slot_file_open, "reserve", reserve)
    try:
        slot_file.recreate()
    finally:
        os.close(old_fd)
    assert seen == [0]
    assert slot_file.file_size() == 4 * SLOT
    slot_file.close()


def test_a_buffer_of_part_of_a_slot_is_refused(tmp_path: Path) -> None:
    """A transfer of a byte more or less than whole slots is a ValueError, and moves
    nothing: a 4097-byte write to slot 0 would spill a byte into slot 1."""
    slot_file = SlotFile(str(tmp_path / "rank0.slots"), 2, SLOT, DiskIOMode.PAGE_CACHE)
    with pytest.raises(ValueError, match="do not fit"):
        slot_file.write(memoryview(b"\xff" * (SLOT + 1)), 0)
    with pytest.raises(ValueError, match="do not fit"):
        slot_file.read(memoryview(bytearray(SLOT - 1)), 1)
    out = bytearray(2 * SLOT)
    slot_file.read(memoryview(out), 0)
    assert out == bytes(2 * SLOT)
    slot_file.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_the_file_is_opened_and_locked_under_the_fork_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persistent: bool
) -> None:
    """A descriptor is opened and locked while `OPEN_LOCK` is held (as `os.fork` holds it),
    also by `recreate()`: a child forked meanwhile by another thread would inherit a
    locked descriptor missing from `OPEN_FILES`, never close it, and hold the lock for as
    long as it lives."""
    owned: list[bool] = []
    real_lock_or_close = slot_file.lock_or_close

    def lock_or_close(fd: int, path: str) -> None:
        owned.append(slot_file_handles.OPEN_LOCK._is_owned())  # type: ignore[attr-defined]
        real_lock_or_close(fd, path)

    monkeypatch.setattr(slot_file, "lock_or_close", lock_or_close)
    opened = SlotFile(
        str(tmp_path / "r.slots"), 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=persistent
    )
    if persistent:
        opened.recreate()
    opened.close()
    assert owned == [True] * (1 + persistent)


def test_recreate_refuses_a_file_that_is_not_persistent(tmp_path: Path) -> None:
    """Only a persistent file is recreated; a fresh one is left open, as it was."""
    path = tmp_path / "rank0.slots"
    fresh = SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE)
    inode = path.stat().st_ino
    with pytest.raises(RuntimeError, match="only for a persistent slot file"):
        fresh.recreate()
    assert fresh.is_open
    assert path.stat().st_ino == inode
    fresh.close()


def test_a_reused_persistent_file_keeps_direct_io(tmp_path: Path) -> None:
    """A direct-I/O tier reopened on its persistent file still bypasses the page cache."""
    path = os.path.join(direct_io_dir(str(tmp_path)), "rank0.slots")
    SlotFile(path, 2, SLOT, DiskIOMode.DIRECT, persistent=True).close()
    reopened = SlotFile(path, 2, SLOT, DiskIOMode.DIRECT, persistent=True)
    try:
        assert reopened.reused
        flags = fcntl.fcntl(reopened._handle.fd, fcntl.F_GETFL)  # type: ignore[arg-type]
        assert flags & os.O_DIRECT
    finally:
        reopened.close()


def test_a_persistent_file_created_by_another_opener_meanwhile_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path named nothing, then its exclusive create found a file there (another
    process made it in between): the open starts over and reuses that file."""
    path = tmp_path / "rank0.slots"
    real_create = slot_file_open.create_exclusive

    def create_exclusive(name: str, mode: DiskIOMode) -> int:
        path.write_bytes(bytes(2 * SLOT))  # the other process wins the race
        monkeypatch.setattr(slot_file_open, "create_exclusive", real_create)
        return real_create(name, mode)

    monkeypatch.setattr(slot_file_open, "create_exclusive", create_exclusive)
    reopened = SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=True)
    assert reopened.reused
    reopened.close()
    assert path.exists()


@pytest.mark.parametrize("persistent", [False, True])
def test_a_symlink_put_at_the_path_meanwhile_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persistent: bool
) -> None:
    """(s31, mutant B22) The path named nothing, then its exclusive create found a
    symlink there (another process made it in between): the open fails saying so, never
    following it nor removing it. The match is on the message's own words: the path in
    it holds the test's name."""
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    path = tmp_path / "rank0.slots"
    real_create = slot_file_open.create_exclusive

    def create_exclusive(name: str, mode: DiskIOMode) -> int:
        path.symlink_to(target)  # the other process wins the race
        monkeypatch.setattr(slot_file_open, "create_exclusive", real_create)
        return real_create(name, mode)

    monkeypatch.setattr(slot_file_open, "create_exclusive", create_exclusive)
    with pytest.raises(FileExistsError, match="disk tier file is a symlink"):
        SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=persistent)
    assert target.read_bytes() == b"keep me"
    assert path.is_symlink()


def test_a_file_created_under_a_narrow_umask_is_still_0600(tmp_path: Path) -> None:
    """A umask of 0277 would make it read-only for its owner: a later persistent open
    (O_RDWR) of the kept file would fail."""
    path = tmp_path / "rank0.slots"
    old_umask = os.umask(0o277)
    try:
        created = SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=True)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    created.close()
    SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=True).close()


def test_a_create_whose_mode_cannot_be_set_leaves_no_file_and_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rank0.slots"

    def fchmod(fd: int, mode: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fchmod", fchmod)
    before = num_open_fds()
    with pytest.raises(OSError, match="Input/output error"):
        SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE)
    assert num_open_fds() == before
    assert not path.exists()


def test_a_stale_file_that_vanishes_before_it_is_replaced_is_created_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The exclusive create found a file, which its owner removed before this open looked
    at it: the open creates the file itself, with no warning of a stale file replaced."""
    path = tmp_path / "rank0.slots"
    real_create = slot_file_open.create_exclusive

    def create_exclusive(name: str, mode: DiskIOMode) -> int:
        monkeypatch.setattr(slot_file_open, "create_exclusive", real_create)
        raise FileExistsError(errno.EEXIST, "File exists", name)  # then it vanished

    monkeypatch.setattr(slot_file_open, "create_exclusive", create_exclusive)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.slot_file_open"):
        created = SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE)
    assert caplog.records == []
    assert path.stat().st_size == 2 * SLOT
    created.close()


def test_a_stale_file_that_cannot_be_removed_is_reported_as_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a directory at the path is 'not a regular file': a stale file that cannot be
    removed (a read-only directory) raises the removal's own error."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"stale")
    real_unlink = os.unlink

    def unlink(name: str, *args: object, **kwargs: object) -> None:
        if os.fspath(name) == str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
        real_unlink(name)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(PermissionError) as caught:
        SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE)
    assert "not a regular file" not in str(caught.value)
    assert path.read_bytes() == b"stale"


def test_a_taken_path_that_cannot_be_looked_at_counts_as_a_file_in_the_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exclusive create found the path taken, and the look at what took it failed
    (it was gone again): a file in the way, so the stale-file path goes on and opens
    the path, never 'not a regular file'."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"stale")
    real_lstat = os.lstat

    def lstat(name: str, *args: object, **kwargs: object) -> os.stat_result:
        monkeypatch.setattr(os, "lstat", real_lstat)  # only the first look fails
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)

    monkeypatch.setattr(os, "lstat", lstat)
    created = SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE)
    assert path.stat().st_size == 2 * SLOT
    created.close()


def test_the_file_is_allocated_so_a_full_disk_fails_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slots are allocated at open (fallocate), not left sparse: a disk without room
    fails the open naming the budget, not a store later."""
    path = tmp_path / "rank0.slots"

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match="cannot size the disk tier file to 2 slots"):
        SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE)
    assert not path.exists()


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_a_filesystem_without_fallocate_gets_a_sized_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    created = SlotFile(str(tmp_path / "rank0.slots"), 2, SLOT, DiskIOMode.PAGE_CACHE)
    assert created.file_size() == 2 * SLOT
    created.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_a_closed_file_leaves_the_fork_list(tmp_path: Path, persistent: bool) -> None:
    """`OPEN_FILES` lists open files only: an engine opening and closing tiers must not
    grow it for ever."""
    before = dict(slot_file_handles.OPEN_FILES)
    opened = SlotFile(
        str(tmp_path / "r.slots"), 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=persistent
    )
    assert len(slot_file_handles.OPEN_FILES) == len(before) + 1
    opened.close()
    assert dict(slot_file_handles.OPEN_FILES) == before
