"""The disk tier's slot file: creation rules, sizing, alignment, short I/O (SPEC §7)."""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import stat
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from storage_helpers import (
    WAIT_S,
    ShortIO,
    direct_io_dir,
    join_all,
    num_open_fds,
    start_until_parked,
)

from kvtier.storage import DiskIOError, DiskIOMode, SlotFile, slot_file_open
from kvtier.storage.slot_file import DiskTierBusyError

MODES = [DiskIOMode.DIRECT, DiskIOMode.PAGE_CACHE]


def aligned(nbytes: int, fill: int) -> memoryview:
    """Return a 4096-aligned writable buffer of `nbytes` filled with `fill`."""
    raw = np.full(nbytes + 4096, fill, dtype=np.uint8)
    shift = -raw.ctypes.data % 4096
    return memoryview(raw[shift : shift + nbytes].data)


def base_dir(tmp_path: Path, mode: DiskIOMode) -> str:
    return direct_io_dir(str(tmp_path)) if mode is DiskIOMode.DIRECT else str(tmp_path)


@pytest.mark.parametrize("mode", MODES)
def test_file_is_fresh_0600_sized_and_removed_on_close(tmp_path: Path, mode: DiskIOMode) -> None:
    """Exclusive create, mode 0600 whatever the umask, slots x bytes, removed at close."""
    path = os.path.join(base_dir(tmp_path, mode), "rank0.slots")
    old_umask = os.umask(0)
    try:
        slot_file = SlotFile(path, 5, 8192, mode)
    finally:
        os.umask(old_umask)
    info = os.stat(path)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == slot_file.file_size() == 5 * 8192
    with pytest.raises(DiskTierBusyError, match="locked by another"):
        SlotFile(path, 5, 8192, mode)
    slot_file.close()
    slot_file.close()
    assert not os.path.exists(path)


def test_a_stale_file_is_replaced_by_a_fresh_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file nobody holds (a crashed run's, or a persistent run's) is removed and created
    afresh with a warning naming it: right size, mode 0600, none of the old bytes."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"\xab" * 20000)
    path.chmod(0o644)
    old_inode = path.stat().st_ino
    with caplog.at_level("WARNING", logger="kvtier.storage.slot_file_open"):
        slot_file = SlotFile(str(path), 2, 4096, DiskIOMode.PAGE_CACHE)
    assert "left by an earlier run" in caplog.text
    assert str(path) in caplog.text
    info = path.stat()
    assert (info.st_size, stat.S_IMODE(info.st_mode)) == (2 * 4096, 0o600)
    assert info.st_ino != old_inode or not path.read_bytes().strip(b"\0")
    assert path.read_bytes() == bytes(2 * 4096)
    slot_file.close()
    assert not path.exists()


def test_a_file_replaced_while_opening_is_refused_and_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the holder of the lock on the file the path names may replace it: a file
    another process put at the path between this one's create and lock is never removed,
    and this one fails naming the path (two engines on one directory and rank)."""
    path = tmp_path / "rank0.slots"
    create = slot_file_open.create_exclusive

    def create_then_lose_the_race(name: str, mode: DiskIOMode) -> int:
        fd = create(name, mode)
        os.unlink(name)  # a rival took the unlocked new file for stale and replaced it
        path.write_bytes(b"rival")
        return fd

    monkeypatch.setattr(slot_file_open, "create_exclusive", create_then_lose_the_race)
    with pytest.raises(DiskTierBusyError, match="replaced by another process"):
        SlotFile(str(path), 2, 4096, DiskIOMode.PAGE_CACHE)
    assert path.read_bytes() == b"rival"


def test_a_stale_file_locked_meanwhile_is_not_replaced(tmp_path: Path) -> None:
    """A leftover that another process opened and locked first is refused, untouched."""
    path = tmp_path / "rank0.slots"
    path.write_bytes(b"\xab" * 8192)
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DiskTierBusyError, match="locked by another"):
            SlotFile(str(path), 2, 4096, DiskIOMode.PAGE_CACHE)
        assert path.read_bytes() == b"\xab" * 8192
    finally:
        os.close(fd)


@pytest.mark.parametrize("persistent", [False, True])
def test_symlink_is_refused_and_its_target_untouched(tmp_path: Path, persistent: bool) -> None:
    """A symlink at the path (even to a writable file) is never followed, nor removed. A
    persistent file is reused without truncation: through a symlink it would reuse (and
    later size) whatever file the link names."""
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    link = tmp_path / "rank0.slots"
    link.symlink_to(target)
    with pytest.raises(FileExistsError, match="disk tier file is a symlink"):
        SlotFile(str(link), 2, 4096, DiskIOMode.PAGE_CACHE, persistent=persistent)
    assert target.read_bytes() == b"keep me"
    assert link.is_symlink()


def test_direct_io_requires_4096_aligned_slots(tmp_path: Path) -> None:
    """SPEC scenario 28: direct I/O rejects 1000-byte slots naming the value; page cache
    accepts them, and no file is left behind by the rejected attempt."""
    path = str(tmp_path / "rank0.slots")
    with pytest.raises(ValueError, match="bytes_per_slot=1000") as error:
        SlotFile(path, 4, 1000, DiskIOMode.DIRECT)
    # Regression: it said "use DiskIOMode.PAGE_CACHE", not which setting takes it (a user
    # of the engine's OffloadConfig, or of a JSON config, writes disk_io_mode='page_cache').
    assert "use disk_io_mode=DiskIOMode.PAGE_CACHE ('page_cache')" in str(error.value)
    assert not os.path.exists(path)
    slot_file = SlotFile(path, 4, 1000, DiskIOMode.PAGE_CACHE)
    slot_file.write(memoryview(bytes(range(250)) * 8), 1)
    out = bytearray(2000)
    slot_file.read(memoryview(out), 1)
    assert bytes(out) == bytes(range(250)) * 8
    slot_file.close()


@pytest.mark.parametrize("mode", MODES)
def test_slots_land_at_k_times_slot_bytes(tmp_path: Path, mode: DiskIOMode) -> None:
    """Slot k lives at byte k x bytes_per_slot of the file."""
    path = os.path.join(base_dir(tmp_path, mode), "rank0.slots")
    slot_file = SlotFile(path, 4, 4096, mode)
    slot_file.write(aligned(8192, 0xAB), 2)
    with open(path, "rb") as raw:
        content = raw.read()
    assert content[: 2 * 4096] == bytes(2 * 4096)
    assert content[2 * 4096 :] == b"\xab" * 8192
    slot_file.close()


def test_short_io_and_out_of_range_are_errors(tmp_path: Path) -> None:
    """A short write or read raises DiskIOError; slots past the end, or before the
    first, raise ValueError."""
    slot_file = SlotFile(str(tmp_path / "f"), 4, 4096, DiskIOMode.PAGE_CACHE, ShortIO())
    with pytest.raises(DiskIOError, match="short write"):
        slot_file.write(memoryview(bytes(4096)), 0)
    with pytest.raises(DiskIOError, match="short read"):
        slot_file.read(memoryview(bytearray(4096)), 0)
    with pytest.raises(ValueError, match="do not fit"):
        slot_file.write(memoryview(bytes(8192)), 3)
    with pytest.raises(ValueError, match=r"slots \[-1, 0\) .* do not fit"):
        slot_file.read(memoryview(bytearray(4096)), -1)
    slot_file.close()
    with pytest.raises(DiskIOError, match="closed"):
        slot_file.write(memoryview(bytes(4096)), 0)


def test_filesystem_without_o_direct_gets_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL at open with O_DIRECT (tmpfs on older kernels) suggests page-cache mode."""
    real_open = os.open

    def refuse_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", refuse_direct)
    with pytest.raises(OSError, match="PAGE_CACHE"):
        SlotFile(str(tmp_path / "f"), 2, 4096, DiskIOMode.DIRECT)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mode", MODES)
def test_a_fifo_at_the_path_is_not_a_regular_file(tmp_path: Path, mode: DiskIOMode) -> None:
    """A FIFO at the path is refused as not a regular file, never waited on, and left
    alone; in direct mode too, where Linux answers EINVAL to O_DIRECT on a FIFO: that is
    not blamed on the filesystem's O_DIRECT support."""
    path = tmp_path / "rank0.slots"
    os.mkfifo(path)
    for persistent in (False, True):
        with pytest.raises(OSError, match="not a regular file") as info:
            SlotFile(str(path), 2, 4096, mode, persistent=persistent)
        assert "O_DIRECT" not in str(info.value)
        assert info.value.filename == str(path)
    assert stat.S_ISFIFO(path.lstat().st_mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_directory_at_the_path_is_not_a_regular_file(tmp_path: Path, mode: DiskIOMode) -> None:
    """Regression: a directory at the path raised a bare IsADirectoryError; it is now
    refused as not a regular file, naming the path and saying what to do, and left alone."""
    path = tmp_path / "rank0.slots"
    path.mkdir()
    num_fds = num_open_fds()
    for persistent in (False, True):
        with pytest.raises(OSError, match=r"not a regular file .*; remove it") as info:
            SlotFile(str(path), 2, 4096, mode, persistent=persistent)
        assert info.value.errno == errno.EINVAL
        assert info.value.filename == str(path)
    assert path.is_dir()
    assert num_open_fds() == num_fds


@pytest.mark.parametrize("persistent", [False, True])
def test_a_dropped_slot_file_is_closed_as_close_would(tmp_path: Path, persistent: bool) -> None:
    """Regression: a SlotFile dropped without close() kept its descriptor, lock and file
    until the process exited. Collection now closes it like close() (removing a
    non-persistent file, keeping a persistent one), with a ResourceWarning."""
    path = str(tmp_path / "rank0.slots")
    num_fds = num_open_fds()
    held = [SlotFile(path, 2, 4096, DiskIOMode.PAGE_CACHE, persistent=persistent)]
    held[0].write(memoryview(b"\xab" * 4096), 1)
    with pytest.warns(ResourceWarning, match="not closed"):
        held.clear()
    assert num_open_fds() == num_fds
    assert os.path.exists(path) == persistent
    reopened = SlotFile(path, 2, 4096, DiskIOMode.PAGE_CACHE, persistent=persistent)
    assert reopened.reused == persistent
    out = bytearray(4096)
    reopened.read(memoryview(out), 1)
    assert out == (b"\xab" if persistent else b"\0") * 4096
    reopened.close()


def test_close_runs_the_cleanup_once(tmp_path: Path) -> None:
    """close() detaches the finalizer: collecting a closed SlotFile does nothing more (no
    warning, no second close of a descriptor number that may be reused meanwhile)."""
    path = str(tmp_path / "rank0.slots")
    slot_file = SlotFile(path, 2, 4096, DiskIOMode.PAGE_CACHE)
    slot_file.close()
    successor = SlotFile(path, 2, 4096, DiskIOMode.PAGE_CACHE)  # may reuse the fd number
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slot_file.close()
        del slot_file
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert successor.is_open
    assert os.path.exists(path)
    successor.write(memoryview(bytes(4096)), 0)
    successor.close()


def test_a_second_close_returns_only_once_the_file_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a second close() while the first was still removing the file returned
    at once, its caller believing the path free while the file and its lock were still
    there. Now each returns once the file is removed and unlocked."""
    path = str(tmp_path / "rank0.slots")
    slot_file = SlotFile(path, 2, 4096, DiskIOMode.PAGE_CACHE)
    release = threading.Event()
    real_unlink = os.unlink

    def slow_unlink(name: str, *args: Any, **kwargs: Any) -> None:
        assert release.wait(WAIT_S)
        real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", slow_unlink)
    file_left: dict[str, bool] = {}

    def close(name: str) -> None:
        slot_file.close()
        file_left[name] = os.path.exists(path)

    first = start_until_parked(lambda: close("first"), "first")  # waits in unlink
    second = start_until_parked(lambda: close("second"), "second")  # waits for it
    assert file_left == {}
    release.set()
    join_all(first, second)
    monkeypatch.undo()
    assert file_left == {"first": False, "second": False}
    SlotFile(path, 2, 4096, DiskIOMode.PAGE_CACHE).close()


def test_close_leaves_a_file_that_replaced_its_own_at_the_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-persistent file whose path now names another file (one that a process
    ignoring the lock put there) closes without removing that file, with a warning
    (SPEC §7: a tier removes only the file it holds)."""
    path = tmp_path / "rank0.slots"
    slot_file = SlotFile(str(path), 2, 4096, DiskIOMode.PAGE_CACHE)
    path.unlink()
    path.write_bytes(b"someone else's")
    with caplog.at_level(logging.WARNING):
        slot_file.close()
    assert path.read_bytes() == b"someone else's"
    assert "was replaced by another file" in caplog.text
