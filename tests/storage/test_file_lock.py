"""The slot file's lock protocol: a file is removed before its lock is released, and an
opener never holds a file that its previous holder is about to remove."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from storage_helpers import num_open_fds, on_another_device

from kvtier.storage import DiskIOMode, SlotFile, slot_file_open
from kvtier.storage.file_lock import (
    DiskTierBusyError,
    finish_removal,
    is_locked,
    lock_exclusive,
    remove_held_file,
)

SLOT = 4096


def open_slot_file(path: str, persistent: bool = False) -> SlotFile:
    return SlotFile(path, 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=persistent)


def file_id(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def assert_owns_path(slot_file: SlotFile, path: str) -> None:
    """Assert that `path` names `slot_file`'s file and that nobody else can open it."""
    pattern = bytes(range(256)) * (SLOT // 256)
    slot_file.write(memoryview(pattern), 1)
    with open(path, "rb") as raw:
        assert raw.read()[SLOT:] == pattern
    with pytest.raises(DiskTierBusyError, match="locked by another"):
        open_slot_file(path)


@pytest.mark.parametrize(
    ("moment", "second_opens"), [("before_unlink", False), ("after_close", True)]
)
def test_an_opener_during_close_never_loses_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str, second_opens: bool
) -> None:
    """Regression: close() released the lock before removing the file. A second opener in
    that gap took the file for stale and replaced it, and the first one's unlink then
    removed the second one's fresh file (a third opener got the path while the second
    lived). Now the file is removed under the lock: an opener before the removal is
    refused, one after the release creates a file that survives the close, locked."""
    path = str(tmp_path / "rank0.slots")
    first = open_slot_file(path)
    first_id = file_id(os.stat(path))
    armed = [True]
    opened: list[SlotFile | DiskTierBusyError] = []

    def open_second() -> None:
        armed[0] = False
        try:
            opened.append(open_slot_file(path))
        except DiskTierBusyError as exc:
            opened.append(exc)

    real_unlink, real_close = os.unlink, os.close

    def unlink(name: str, *args: Any, **kwargs: Any) -> None:
        if armed[0] and moment == "before_unlink" and name == path:
            open_second()
        real_unlink(name, *args, **kwargs)

    def close(fd: int) -> None:
        closes_first = armed[0] and file_id(os.fstat(fd)) == first_id
        real_close(fd)
        if closes_first and moment == "after_close":
            open_second()

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "close", close)
    first.close()
    monkeypatch.undo()
    (second,) = opened
    if not second_opens:
        assert isinstance(second, DiskTierBusyError)
        assert "locked by another" in str(second)
        assert not os.path.exists(path)
        second = open_slot_file(path)  # the path is free once the close returned
    assert isinstance(second, SlotFile)
    assert_owns_path(second, path)
    second.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_file_its_holder_removes_while_opening_is_opened_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persistent: bool
) -> None:
    """An opener that opened the file of a holder which then closed (removing it) gets the
    lock of a file that is no longer at the path: it starts over and creates a fresh file,
    instead of failing as if another process had taken the path."""
    path = str(tmp_path / "rank0.slots")
    first = open_slot_file(path)
    open_or_create = slot_file_open.open_or_create

    def open_then_holder_closes(name: str, mode: DiskIOMode) -> tuple[int, bool]:
        fd, existed = open_or_create(name, mode)
        if existed and first.is_open:
            first.close()
        return fd, existed

    monkeypatch.setattr(slot_file_open, "open_or_create", open_then_holder_closes)
    num_fds = num_open_fds()
    second = open_slot_file(path, persistent)
    assert not first.is_open
    assert not second.reused
    assert os.path.getsize(path) == 2 * SLOT
    assert_owns_path(second, path)
    second.close()
    assert os.path.exists(path) == persistent
    assert num_open_fds() == num_fds - 1  # first's descriptor, and the retried one's, closed


def test_the_sizing_failure_removes_the_file_before_unlocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A created file that cannot be sized is removed while its lock is still held."""
    path = str(tmp_path / "rank0.slots")
    events: list[str] = []
    real_unlink, real_close = os.unlink, os.close

    def unlink(name: str, *args: Any, **kwargs: Any) -> None:
        events.append("unlink" if name == path else "other")
        real_unlink(name, *args, **kwargs)

    def close(fd: int) -> None:
        events.append("close")
        real_close(fd)

    def no_space(fd: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(slot_file_open, "reserve", no_space)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "close", close)
    with pytest.raises(OSError, match="cannot size the disk tier file"):
        open_slot_file(path)
    monkeypatch.undo()
    assert events == ["unlink", "close"]
    assert not os.path.exists(path)


def test_a_forked_child_never_removes_the_parents_file(tmp_path: Path) -> None:
    """A child forked while a SlotFile is open shares its descriptor and lock; the child's
    close (or collection, or exit) closes only its copy: the file stays, locked."""
    path = str(tmp_path / "rank0.slots")
    slot_file = open_slot_file(path)
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only the close and a raw exit
        code = 1
        try:
            slot_file.close()
            code = 0 if os.path.exists(path) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert_owns_path(slot_file, path)
    slot_file.close()
    assert not os.path.exists(path)


def test_a_forked_child_that_outlives_the_tier_does_not_hold_its_lock(tmp_path: Path) -> None:
    # Regression: a child forked while a persistent tier was open (a worker's helper
    # process) inherited the locked descriptor; once the tier closed, the next engine's
    # open of the path failed as busy for as long as the child lived.
    path = str(tmp_path / "rank0.slots")
    slot_file = open_slot_file(path, persistent=True)
    release_child, child_waits = os.pipe()
    child_ready, parent_waits = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds on until the parent has reopened the path
        code = 1
        try:
            os.close(child_waits)
            code = 0 if not slot_file.is_open else 2
            os.write(parent_waits, b"r")  # its copy is closed (at the fork) by now
            os.read(release_child, 1)
        finally:
            os._exit(code)
    os.close(release_child)
    os.close(parent_waits)
    try:
        assert os.read(child_ready, 1) == b"r"
        slot_file.close()
        reopened = open_slot_file(path, persistent=True)
        assert reopened.reused
        reopened.close()
    finally:
        os.close(child_waits)  # the child's read returns: it exits
        os.close(child_ready)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_finished_removal_leaves_a_file_that_replaced_the_held_one(tmp_path: Path) -> None:
    """(s30 mutation run) `finish_removal` after an interrupted close removes the path only
    while it still names the held file: one another opener put there is its own."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"held")
    fd = os.open(path, os.O_RDONLY)
    try:
        path.unlink()
        path.write_bytes(b"another opener's")
        finish_removal(fd, str(path))
        assert path.read_bytes() == b"another opener's"
        path.unlink()
        finish_removal(fd, str(path))  # nothing there: quiet
    finally:
        os.close(fd)


def test_a_symlink_to_the_held_file_is_not_the_held_file(tmp_path: Path) -> None:
    """(s30 mutation run) Neither the removal at close nor the lock probe follows a
    symlink at the path, even one to the held file itself."""
    held = tmp_path / "held.slots"
    link = tmp_path / "rank0.slots"
    slot_file = open_slot_file(str(held), persistent=True)
    link.symlink_to(held)
    try:
        assert is_locked(str(held))
        assert not is_locked(str(link))
        remove_held_file(slot_file._handle.fd, str(link))  # type: ignore[arg-type]
        assert link.is_symlink()
    finally:
        slot_file.close()


def lstat_on_another_device(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Make `os.lstat(path)` report the file there on another device, same inode number."""
    real_lstat = os.lstat

    def lstat(name: Any) -> os.stat_result:
        info = real_lstat(name)
        return on_another_device(info) if os.fspath(name) == str(path) else info

    monkeypatch.setattr(os, "lstat", lstat)


def test_a_file_of_the_same_inode_number_on_another_device_was_not_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(s31, mutant D15) A lock taken on a file that the path, checked next, shows on
    another device is refused as a replaced file, though the inode numbers match: files
    are told apart by device and inode."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"opened")
    fd = os.open(path, os.O_RDONLY)
    try:
        lstat_on_another_device(monkeypatch, path)
        with pytest.raises(DiskTierBusyError, match="replaced by another process"):
            lock_exclusive(fd, str(path))
    finally:
        os.close(fd)


def test_a_file_of_the_same_inode_number_on_another_device_is_not_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """(s31, mutant D15) Neither the removal at close nor its finishing after an interrupt
    removes a file that the path shows on another device, though its inode number is the
    held file's."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"held")
    fd = os.open(path, os.O_RDONLY)
    try:
        lstat_on_another_device(monkeypatch, path)
        remove_held_file(fd, str(path))
        assert "replaced by another file" in caplog.text
        finish_removal(fd, str(path))
        assert path.read_bytes() == b"held"
    finally:
        os.close(fd)
