"""The disk tier's backing file: one per rank, slot k at byte `k * bytes_per_slot`.

By default the file is created fresh (exclusive create, mode 0600, never through a
symlink) and removed by `close()`. A persistent file (`persistent=True`) reuses an
existing regular file at the path (opened without truncation, never through a symlink;
`reused` says so, and the caller checks its size and contents) or creates a fresh one, and
is kept by `close()`. Either way the open file holds an advisory lock (`flock`, exclusive,
non-blocking) for its lifetime: a second process opening it gets `DiskTierBusyError`.
All I/O goes through a `FileIO` object so tests can inject faults (a refused write, a
short write, a full disk). A short read or write is an error, never retried: on a regular
file it means the device ran out of space or the file shrank.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from typing import Protocol

from kvtier.offload.config import DiskIOMode

__all__ = [
    "DIRECT_IO_ALIGNMENT",
    "DiskIOError",
    "DiskIOMode",
    "DiskTierBusyError",
    "FileIO",
    "OsFileIO",
    "SlotFile",
    "is_locked",
    "unlink_quietly",
]

logger = logging.getLogger(__name__)

DIRECT_IO_ALIGNMENT = 4096
_NOT_REGULAR = "disk tier path is not a regular file (a FIFO, socket, device or directory?)"


class DiskIOError(OSError):
    """A disk tier transfer failed (I/O error, short read/write, checksum mismatch)."""


class DiskTierBusyError(OSError):
    """The slot file is locked by another open file (another engine on the same directory
    and rank, or a second worker of this process)."""


class FileIO(Protocol):
    """Positional reads and writes on a file descriptor; return the bytes moved."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int: ...

    def pread(self, fd: int, into: memoryview, offset: int) -> int: ...


class OsFileIO:
    """`FileIO` on the operating system's `pwrite` / `preadv` (the GIL is released)."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """Write `data` at `offset`; return the bytes written."""
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        """Read into `into` from `offset`; return the bytes read."""
        return os.preadv(fd, [into], offset)


class SlotFile:
    """The rank's slot file: `num_slots * bytes_per_slot` bytes, created and sized at once
    (or, when `persistent`, an existing file reused as it is: see `reused`).

    A non-persistent file is created fresh: a regular file no process holds at the path
    (left by a crashed or persistent run) is replaced, with a warning. Raises
    FileExistsError when the path is a symlink (or a file appears there while this one is
    created); ValueError for direct I/O with slot bytes that are not a multiple of 4096
    (SPEC scenario 28); OSError when the path holds something other than a regular file,
    or with a hint when the filesystem refuses O_DIRECT;
    DiskTierBusyError when another open file holds the lock, or replaced the file while
    this one opened it. Reads and writes may run from any thread; `close()` and
    `recreate()` must not race them.
    """

    def __init__(
        self,
        path: str,
        num_slots: int,
        bytes_per_slot: int,
        mode: DiskIOMode,
        file_io: FileIO | None = None,
        *,
        persistent: bool = False,
    ) -> None:
        if num_slots <= 0 or bytes_per_slot <= 0:
            raise ValueError(
                f"disk tier needs positive sizes, got {num_slots} slots of {bytes_per_slot} B"
            )
        if mode is DiskIOMode.DIRECT and bytes_per_slot % DIRECT_IO_ALIGNMENT:
            raise ValueError(
                f"direct I/O needs slot bytes that are a multiple of {DIRECT_IO_ALIGNMENT}, "
                f"got bytes_per_slot={bytes_per_slot}; use DiskIOMode.PAGE_CACHE"
            )
        self.path = path
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot
        self.mode = mode
        self.persistent = persistent
        self._io: FileIO = file_io if file_io is not None else OsFileIO()
        self._fd: int | None = None
        if persistent:
            fd, self.reused = _open_or_create(path, mode)
        else:
            fd, self.reused = _create_replacing_stale(path, mode), False
        self._adopt(fd, created=not self.reused)

    def _adopt(self, fd: int, created: bool) -> None:
        """Lock `fd` and make it the open file, sizing it when this object `created` it.

        On failure close it (and remove the file if sizing a created file failed)."""
        try:
            _lock(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        if created:
            try:
                _reserve(fd, self.num_slots * self.bytes_per_slot)
            except OSError as exc:
                os.close(fd)
                unlink_quietly(self.path)
                raise OSError(
                    exc.errno,
                    f"cannot size the disk tier file to {self.num_slots} slots x "
                    f"{self.bytes_per_slot} B: {exc.strerror or exc}",
                    self.path,
                ) from exc
        self._fd = fd

    def recreate(self) -> None:
        """Replace a persistent file by a fresh, sized one (its contents are discarded).

        The lock on the old file is held until the new one is created and locked."""
        if not self.persistent:
            raise RuntimeError("recreate() is only for a persistent slot file")
        old, self._fd = self._fd, None
        try:
            unlink_quietly(self.path)
            self._adopt(_create(self.path, self.mode), created=True)
        finally:
            if old is not None:
                os.close(old)
        self.reused = False

    @property
    def is_open(self) -> bool:
        """Return True until `close()`."""
        return self._fd is not None

    def write(self, data: memoryview, first_slot: int) -> None:
        """Write whole slots starting at `first_slot`; raise DiskIOError on any failure."""
        self._transfer(data, first_slot, is_write=True)

    def read(self, into: memoryview, first_slot: int) -> None:
        """Read whole slots starting at `first_slot` into `into`; raise DiskIOError."""
        self._transfer(into, first_slot, is_write=False)

    def _transfer(self, buf: memoryview, first_slot: int, is_write: bool) -> None:
        fd = self._fd
        if fd is None:
            raise DiskIOError(errno.EBADF, "disk tier file is closed", self.path)
        num_slots, rest = divmod(buf.nbytes, self.bytes_per_slot)
        if rest or first_slot < 0 or first_slot + num_slots > self.num_slots:
            raise ValueError(
                f"slots [{first_slot}, {first_slot + num_slots}) of {buf.nbytes} B do not fit "
                f"{self.num_slots} slots of {self.bytes_per_slot} B"
            )
        offset = first_slot * self.bytes_per_slot
        verb = "write" if is_write else "read"
        try:
            moved = (
                self._io.pwrite(fd, buf, offset) if is_write else self._io.pread(fd, buf, offset)
            )
        except OSError as exc:
            raise DiskIOError(
                exc.errno,
                f"{verb} of {buf.nbytes} B at {offset} failed: {exc.strerror or exc}",
                self.path,
            ) from exc
        if moved != buf.nbytes:
            raise DiskIOError(
                errno.EIO, f"short {verb}: {moved} of {buf.nbytes} B at {offset}", self.path
            )

    def file_size(self) -> int:
        """Return the current size of the file in bytes."""
        if self._fd is None:
            raise DiskIOError(errno.EBADF, "disk tier file is closed", self.path)
        return os.fstat(self._fd).st_size

    def sync(self) -> None:
        """Flush the file's data to the device (`fsync`); raise OSError naming the file."""
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot sync the disk tier file: {exc.strerror or exc}", self.path
            ) from exc

    def close(self) -> None:
        """Close the file and remove it unless it is persistent; idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)
        if self.persistent:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            logger.warning("disk tier file %s vanished before shutdown", self.path)


def _open_or_create(path: str, mode: DiskIOMode) -> tuple[int, bool]:
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
                return _create(path, mode), False
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
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, _NOT_REGULAR, path)
        os.set_blocking(fd, True)
        return fd, True
    raise OSError(errno.EAGAIN, "disk tier file keeps appearing and vanishing", path)


def _create_replacing_stale(path: str, mode: DiskIOMode) -> int:
    """Create `path` fresh; first remove a regular file there that no process holds.

    Such a file was left by a run that crashed, or that kept it (persistence on); a
    non-persistent tier never reads what it did not write in this run, so nothing of it
    is used. A file another process holds raises `DiskTierBusyError`; a symlink is
    refused and left alone.
    """
    try:
        return _create(path, mode)
    except FileExistsError:
        if os.path.islink(path):
            raise
    fd, existed = _open_or_create(path, mode)
    if not existed:
        return fd  # it vanished meanwhile and this call created it
    try:
        _lock(fd, path)  # held by a live process, or already replaced: DiskTierBusyError
        logger.warning(
            "disk tier file %s was left by an earlier run (crashed, or persistent); "
            "replacing it with a fresh one",
            path,
        )
        unlink_quietly(path)
        return _create(path, mode)
    finally:
        os.close(fd)  # drops the old file's lock once its replacement exists


def _create(path: str, mode: DiskIOMode) -> int:
    """Create `path` exclusively with mode 0600, refusing symlinks."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    if mode is DiskIOMode.DIRECT:
        flags |= os.O_DIRECT
    try:
        fd = _open(path, flags, mode)
    except FileExistsError as exc:
        what = "a symlink" if os.path.islink(path) else "an existing file"
        raise FileExistsError(
            exc.errno,
            f"disk tier file is {what} (left by a crashed run or in use by another "
            "process); refusing to reuse it, remove it first",
            path,
        ) from exc
    try:
        os.fchmod(fd, 0o600)  # the umask may have narrowed it; make it exact
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


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


def is_locked(path: str) -> bool:
    """Return True when another open file holds the lock of the file at `path`; never
    blocks or follows a symlink (a path that cannot be opened is not locked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a holder's LOCK_EX
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the probe's own lock


def _lock(fd: int, path: str) -> None:
    """Take the exclusive advisory lock of `fd` without waiting; DiskTierBusyError if held,
    or if `path` no longer names the locked file (another process replaced it meanwhile).

    Only the holder of the lock on the file `path` names may remove or replace it, so a
    file held by a live process is never removed.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise DiskTierBusyError(
            exc.errno,
            "disk tier file is locked by another process or worker (two engines must not "
            "share a disk tier directory for the same rank)",
            path,
        ) from exc
    locked = os.fstat(fd)
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        named = None
    if named is None or (named.st_dev, named.st_ino) != (locked.st_dev, locked.st_ino):
        raise DiskTierBusyError(
            errno.EBUSY,
            "disk tier file was replaced by another process while this one opened it (two "
            "engines must not share a disk tier directory for the same rank)",
            path,
        )


def unlink_quietly(path: str) -> None:
    """Remove `path` (a symlink itself, never its target) if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _reserve(fd: int, nbytes: int) -> None:
    """Size the file to `nbytes`, allocating the blocks when the filesystem can."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)
