"""How a disk tier's slot file is opened or created at its path (see `slot_file`):
exclusive create with mode 0600, never through a symlink, replacing a stale file no
process holds, reusing a persistent one, a hint when the filesystem refuses O_DIRECT, and
sizing. Every error names the path; a directory (or another object that is not a regular
file) at the path is refused as not a regular file wherever it is met, also when it
appears there while the path is being opened.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat

from kvtier.offload.config import DiskIOMode
from kvtier.storage.file_lock import lock_exclusive, unlink_quietly

__all__ = ["create_exclusive", "create_replacing_stale", "open_or_create", "reserve", "unlink_file"]

logger = logging.getLogger(__name__)

_NOT_REGULAR = (
    "disk tier path is not a regular file (a FIFO, socket, device or directory?); remove "
    "it or give the disk tier another path"
)


def open_or_create(path: str, mode: DiskIOMode) -> tuple[int, bool]:
    """Open the regular file at `path` without truncation, or create it; refuse symlinks.

    Return the descriptor and whether an existing file was opened."""
    # O_NONBLOCK: never wait on a FIFO at the path (no effect on a regular file).
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if mode is DiskIOMode.DIRECT:
        flags |= os.O_DIRECT
    for _ in range(2):  # a file created or removed by a racing process: one retry
        try:
            fd = _open(path, flags, mode)
        except FileNotFoundError:
            try:
                return create_exclusive(path, mode), False
            except FileExistsError:
                if os.path.islink(path):
                    raise
                continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FileExistsError(
                    errno.EEXIST,
                    "disk tier file is a symlink; refusing to follow it, remove it first",
                    path,
                ) from exc
            if exc.errno == errno.EISDIR:  # O_RDWR refuses a directory before fstat
                raise OSError(errno.EINVAL, _NOT_REGULAR, path) from exc
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, _NOT_REGULAR, path)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd, True
    raise OSError(errno.EAGAIN, "disk tier file keeps appearing and vanishing", path)


def create_replacing_stale(path: str, mode: DiskIOMode) -> int:
    """Create `path` fresh; first remove a regular file there that no process holds.

    Such a file was left by a run that crashed, or that kept it (persistence on); a
    non-persistent tier never reads what it did not write in this run, so nothing of it
    is used. A file another process holds raises `DiskTierBusyError`; a symlink is
    refused and left alone.
    """
    try:
        return create_exclusive(path, mode)
    except FileExistsError:
        if os.path.islink(path):
            raise
    fd, existed = open_or_create(path, mode)
    if not existed:
        return fd  # it vanished meanwhile and this call created it
    try:
        # Held by a live process, or already replaced: DiskTierBusyError. Removed by its
        # holder at close: LockedFileRemovedError, and the caller opens the path anew.
        lock_exclusive(fd, path)
        logger.warning(
            "disk tier file %s was left by an earlier run (crashed, or persistent); "
            "replacing it with a fresh one",
            path,
        )
        unlink_file(path)
        return create_exclusive(path, mode)
    finally:
        os.close(fd)  # drops the old file's lock once its replacement exists


def create_exclusive(path: str, mode: DiskIOMode) -> int:
    """Create `path` exclusively with mode 0600, refusing symlinks.

    Raises FileExistsError when a file or symlink is at the path, and OSError (not a
    regular file) when a directory or another object is."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    if mode is DiskIOMode.DIRECT:
        flags |= os.O_DIRECT
    try:
        fd = _open(path, flags, mode)
    except FileExistsError as exc:
        raise _taken_error(path, exc) from exc
    try:
        os.fchmod(fd, 0o600)  # the umask may have narrowed it; make it exact
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def unlink_file(path: str) -> None:
    """Remove the file (or symlink) at `path` if there is one; raise OSError naming the
    path, not a regular file, when a directory is there."""
    try:
        unlink_quietly(path)
    except OSError as exc:
        if not _is_directory(path):
            raise
        raise OSError(errno.EINVAL, _NOT_REGULAR, path) from exc


def _taken_error(path: str, exc: FileExistsError) -> OSError:
    """Return the error for `path` that an exclusive create found taken (`exc`)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # gone again, or cannot be looked at: report a file in the way
        mode = stat.S_IFREG
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        return OSError(errno.EINVAL, _NOT_REGULAR, path)
    what = "a symlink" if stat.S_ISLNK(mode) else "an existing file"
    return FileExistsError(
        exc.errno,
        f"disk tier file is {what} (left by a crashed run or in use by another "
        "process); refusing to reuse it, remove it first",
        path,
    )


def _is_directory(path: str) -> bool:
    """Return True when `path` itself (never a symlink's target) is a directory."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _open(path: str, flags: int, mode: DiskIOMode) -> int:
    """`os.open` with mode 0600 and a hint when the filesystem refuses O_DIRECT.

    Linux also answers EINVAL to O_DIRECT on a FIFO or socket: the hint is given only
    when the path holds a regular file or nothing, otherwise the error says what is wrong.
    """
    try:
        return os.open(path, flags, 0o600)
    except OSError as exc:
        if mode is not DiskIOMode.DIRECT or exc.errno != errno.EINVAL:
            raise
        with contextlib.suppress(FileNotFoundError):  # nothing there: refused to create it
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise OSError(exc.errno, _NOT_REGULAR, path) from exc
        raise OSError(
            exc.errno,
            "the filesystem refused O_DIRECT (it has no direct I/O, e.g. tmpfs on older "
            "kernels); use disk_io_mode=DiskIOMode.PAGE_CACHE ('page_cache') or a "
            "directory on a block device",
            path,
        ) from exc


def reserve(fd: int, nbytes: int) -> None:
    """Size the file to `nbytes`, allocating the blocks when the filesystem can."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)
