"""Faults around the slot file's path: a file that cannot be removed at close (or after a
failed sizing), and a directory made at the path while it is being opened or recreated."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from storage_helpers import WAIT_S, join_all, num_open_fds, start_until_parked

from kvtier.storage import DiskIOMode, SlotFile, slot_file_open
from kvtier.storage.file_lock import is_locked

SLOT = 4096

pytestmark = pytest.mark.timeout(60)


def open_slot_file(path: Path, persistent: bool = False) -> SlotFile:
    return SlotFile(str(path), 2, SLOT, DiskIOMode.PAGE_CACHE, persistent=persistent)


def refuse_unlink(monkeypatch: pytest.MonkeyPatch, path: Path, code: int) -> None:
    """Make removing `path` fail with `code` (as a read-only directory or a failing device
    makes it fail); other paths are removed as usual."""
    real_unlink = os.unlink

    def unlink(name: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(name) == str(path):
            raise OSError(code, os.strerror(code), os.fspath(name))
        real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


def make_directory_after_unlink(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Make a directory appear at `path` right after the file there is removed: the race
    with another process that the open cannot rule out."""
    real_unlink = os.unlink

    def unlink(name: Any, *args: Any, **kwargs: Any) -> None:
        real_unlink(name, *args, **kwargs)
        if os.fspath(name) == str(path):
            os.mkdir(path)

    monkeypatch.setattr(os, "unlink", unlink)


def assert_reopens_fresh(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Assert that a new slot file opens at `path`, replacing the file left there."""
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.slot_file_open"):
        successor = open_slot_file(path)
    assert "left by an earlier run" in caplog.text
    successor.close()
    assert not path.exists()


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.EIO])
def test_a_file_that_cannot_be_removed_is_left_and_the_close_completes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    code: int,
) -> None:
    """Regression: close() raised the unlink's OSError (a read-only directory, an I/O
    error). Now it logs a warning naming the file and the error, leaves the file, releases
    the descriptor and the lock, and is closed: a second close() does nothing, and the
    next open replaces the leftover as a stale file."""
    path = tmp_path / "rank0.slots"
    num_fds = num_open_fds()
    slot_file = open_slot_file(path)
    refuse_unlink(monkeypatch, path, code)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.file_lock"):
        slot_file.close()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert str(path) in caplog.text
    assert os.strerror(code) in caplog.text
    assert not slot_file.is_open
    assert num_open_fds() == num_fds
    assert path.exists()
    assert not is_locked(str(path))
    caplog.clear()
    slot_file.close()
    assert caplog.records == []
    monkeypatch.undo()
    assert_reopens_fresh(path, caplog)


def test_concurrent_closers_return_when_the_removal_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close() waiting for another one whose removal fails returns once the file is
    closed and unlocked, and neither call raises."""
    path = tmp_path / "rank0.slots"
    slot_file = open_slot_file(path)
    release = threading.Event()
    real_unlink = os.unlink

    def failing_unlink(name: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(name) != str(path):
            real_unlink(name, *args, **kwargs)
            return
        assert release.wait(WAIT_S)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(name))

    monkeypatch.setattr(os, "unlink", failing_unlink)
    outcome: dict[str, str] = {}

    def close(name: str) -> None:
        try:
            slot_file.close()
        except OSError as exc:
            outcome[name] = repr(exc)
            return
        outcome[name] = "locked" if is_locked(str(path)) else "released"

    first = start_until_parked(lambda: close("first"), "first")  # waits in unlink
    second = start_until_parked(lambda: close("second"), "second")  # waits for it
    assert outcome == {}
    release.set()
    join_all(first, second)
    monkeypatch.undo()
    assert outcome == {"first": "released", "second": "released"}
    assert not slot_file.is_open
    slot_file.close()


def test_a_dropped_file_that_cannot_be_removed_is_released_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Collection closes a SlotFile whose removal fails as close() does: the descriptor
    and lock released, the file left with a logged warning, and the ResourceWarning for
    the missing close() still given."""
    path = tmp_path / "rank0.slots"
    num_fds = num_open_fds()
    held = [open_slot_file(path)]
    refuse_unlink(monkeypatch, path, errno.EACCES)
    with (
        caplog.at_level(logging.WARNING, logger="kvtier.storage.file_lock"),
        pytest.warns(ResourceWarning, match="not closed"),
    ):
        held.clear()
    assert "cannot remove disk tier file" in caplog.text
    assert num_open_fds() == num_fds
    assert not is_locked(str(path))
    monkeypatch.undo()
    assert_reopens_fresh(path, caplog)


def test_a_failed_sizing_is_reported_even_when_the_file_cannot_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: when sizing a new file failed and removing it failed too, the open
    raised the removal's error and hid the cause. It now raises the sizing error naming
    the file, warns that the file was left, and holds nothing open."""
    path = tmp_path / "rank0.slots"

    def full_disk(fd: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(slot_file_open, "reserve", full_disk)
    refuse_unlink(monkeypatch, path, errno.EACCES)
    num_fds = num_open_fds()
    with (
        caplog.at_level(logging.WARNING, logger="kvtier.storage.file_lock"),
        pytest.raises(OSError, match="cannot size the disk tier file") as info,
    ):
        open_slot_file(path)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(path)
    assert "cannot remove disk tier file" in caplog.text
    assert num_open_fds() == num_fds
    assert not is_locked(str(path))
    monkeypatch.undo()
    assert_reopens_fresh(path, caplog)


def test_a_directory_made_while_a_stale_file_is_replaced_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a directory made at the path between the removal of a stale file and
    the creation of its replacement was reported as "an existing file (left by a crashed
    run ...)". It is now refused as not a regular file, naming the path, as a directory
    found there at once is, and nothing is left open or locked."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"\xab" * SLOT)
    make_directory_after_unlink(monkeypatch, path)
    num_fds = num_open_fds()
    with pytest.raises(OSError, match=r"not a regular file .*; remove it") as info:
        open_slot_file(path)
    assert info.value.errno == errno.EINVAL
    assert info.value.filename == str(path)
    assert num_open_fds() == num_fds
    monkeypatch.undo()
    assert path.is_dir()
    path.rmdir()
    open_slot_file(path).close()


@pytest.mark.parametrize("moment", ["before_recreate", "after_unlink"])
def test_a_directory_at_the_path_of_a_recreated_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """Regression: recreate() of a persistent file met a directory at its path (put there
    before the call, or right after it removed the old file) with a bare
    IsADirectoryError or "an existing file". It now raises OSError naming the path as not
    a regular file, the old file is closed and unlocked, and close() returns quietly."""
    path = tmp_path / "rank0.slots"
    num_fds = num_open_fds()
    slot_file = open_slot_file(path, persistent=True)
    if moment == "before_recreate":
        path.unlink()
        path.mkdir()
    else:
        make_directory_after_unlink(monkeypatch, path)
    with pytest.raises(OSError, match=r"not a regular file .*; remove it") as info:
        slot_file.recreate()
    monkeypatch.undo()
    assert info.value.errno == errno.EINVAL
    assert info.value.filename == str(path)
    assert not slot_file.is_open
    slot_file.close()
    assert num_open_fds() == num_fds
    path.rmdir()
    reopened = open_slot_file(path, persistent=True)
    assert not reopened.reused
    reopened.close()


@pytest.mark.parametrize("failing", ["fstat", "set_blocking"])
def test_an_existing_file_whose_checks_fail_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Regression: open_or_create() left the descriptor of an existing file open when
    os.fstat or os.set_blocking raised after os.open succeeded. It is closed now and the
    error passes through unchanged."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"\xab" * SLOT)

    def fail(*args: Any) -> None:
        raise OSError(errno.EIO, "injected", str(path))

    num_fds = num_open_fds()
    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match="injected"):
        slot_file_open.open_or_create(str(path), DiskIOMode.PAGE_CACHE)
    monkeypatch.undo()
    assert num_open_fds() == num_fds
