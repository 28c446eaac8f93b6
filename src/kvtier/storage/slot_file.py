"""The disk tier's backing file: one per rank, slot k at byte `k * bytes_per_slot`.

By default the file is created fresh (exclusive create, mode 0600, never through a
symlink) and removed by `close()`. A persistent file (`persistent=True`) reuses an
existing regular file at the path (opened without truncation, never through a symlink;
`reused` says so, and the caller checks its size and contents) or creates a fresh one, and
is kept by `close()`. Either way the open file holds an advisory lock (`flock`, exclusive,
non-blocking) for its lifetime: a second process opening it gets `DiskTierBusyError` (the
protocol is in `file_lock`; how the path is opened or created, in `slot_file_open`). A
`SlotFile` collected without `close()` is closed (and removed) all the same, with a
`ResourceWarning`, as a Python file object is.
All I/O goes through a `FileIO` object so tests can inject faults (a refused write, a
short write, a full disk). A short read or write is an error, never retried: on a regular
file it means the device ran out of space or the file shrank.
"""

from __future__ import annotations

import contextlib
import errno
import os
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

from kvtier.offload.config import DiskIOMode
from kvtier.storage import slot_file_open
from kvtier.storage.close_gate import CloseGate
from kvtier.storage.file_lock import (
    DiskTierBusyError,
    LockedFileRemovedError,
    is_locked,
    lock_or_close,
    remove_held_file,
    unlink_quietly,
)
from kvtier.storage.slot_file_handles import (
    OPEN_FILES,
    OPEN_LOCK,
    OpenFile,
    free_if_unnamed,
    release,
    release_dropped,
)

__all__ = [
    "DIRECT_IO_ALIGNMENT",
    "BadSlotsError",
    "DiskIOError",
    "DiskIOMode",
    "DiskTierBusyError",
    "FileIO",
    "OsFileIO",
    "SlotFile",
    "is_locked",
    "unlink_quietly",
]

DIRECT_IO_ALIGNMENT = 4096
_OPEN_ATTEMPTS = 3  # opens that find the file removed by its closing holder: start over


class DiskIOError(OSError):
    """A disk tier transfer failed (I/O error, short read/write, checksum mismatch)."""


class BadSlotsError(DiskIOError):
    """A read whose bytes arrived, but `slots` (slot ids, sorted) hold no valid data or fail
    their checksum; every other slot of the read was verified. Picklable with its slots
    (vLLM's workers run in other processes)."""

    def __init__(
        self, slots: Iterable[int], message: str, path: str, code: int | None = errno.EIO
    ) -> None:
        super().__init__(code, message, path)
        self.slots = tuple(sorted(slots))

    def __reduce__(self) -> tuple[Any, ...]:
        # OSError's own would call __init__(errno, strerror, filename).
        return type(self), (self.slots, self.strerror, self.filename, self.errno)


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
    this one opened it. A file its holder removes while this one opens it is opened anew.
    Reads and writes may run from any thread; `close()` and `recreate()` must not race them.
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
        if not isinstance(mode, DiskIOMode):  # "direct" would silently be page-cache I/O
            raise ValueError(f"disk I/O mode must be a DiskIOMode, got {mode!r}")
        if mode is DiskIOMode.DIRECT and bytes_per_slot % DIRECT_IO_ALIGNMENT:
            raise ValueError(
                f"direct I/O needs slot bytes that are a multiple of {DIRECT_IO_ALIGNMENT}, "
                f"got bytes_per_slot={bytes_per_slot}; use disk_io_mode=DiskIOMode.PAGE_CACHE "
                "('page_cache')"
            )
        self.path = path
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot
        self.mode = mode
        self.persistent = persistent
        self._io: FileIO = file_io if file_io is not None else OsFileIO()
        self._closing = CloseGate()
        self._handle = OpenFile(path, persistent)
        with OPEN_LOCK:  # a fork meanwhile waits: the child must know of this file
            self._handle.fd, self.reused = self._open()
            OPEN_FILES[id(self._handle)] = self._handle
        self._finalizer = weakref.finalize(self, release_dropped, self._handle)

    def _open(self) -> tuple[int, bool]:
        """Return the locked descriptor and whether it is an existing file, reused."""
        for _ in range(_OPEN_ATTEMPTS - 1):
            with contextlib.suppress(LockedFileRemovedError):
                return self._open_once()
        return self._open_once()

    def _open_once(self) -> tuple[int, bool]:
        if self.persistent:
            fd, reused = slot_file_open.open_or_create(self.path, self.mode)
        else:
            fd, reused = slot_file_open.create_replacing_stale(self.path, self.mode), False
        lock_or_close(fd, self.path)
        if not reused:
            self._size_or_remove(fd)
        return fd, reused

    def _size_or_remove(self, fd: int) -> None:
        """Size the locked file `fd` that this object created; on failure remove it (while
        still holding its lock; see `remove_held_file`), close it and raise OSError naming
        it."""
        try:
            slot_file_open.reserve(fd, self.num_slots * self.bytes_per_slot)
        except OSError as exc:
            try:
                remove_held_file(fd, self.path)
            finally:
                os.close(fd)
            raise OSError(
                exc.errno,
                f"cannot size the disk tier file to {self.num_slots} slots x "
                f"{self.bytes_per_slot} B (the disk tier's budget, disk_bytes; lower it or "
                f"free space): {exc.strerror or exc}",
                self.path,
            ) from exc

    def resize(self) -> None:
        """Size a reused persistent file to `num_slots` (the tier's budget changed): a
        shrink cuts off the slots past the new end, a grow adds slots (allocated when the
        filesystem can). Raises OSError naming the path and `disk_bytes` when the disk
        has no room for the larger file; the file is then cut back to its size before."""
        fd = self._handle.fd
        if fd is None:
            raise DiskIOError(errno.EBADF, "disk tier file is closed", self.path)
        nbytes = self.num_slots * self.bytes_per_slot
        before = self.file_size()
        grow = nbytes > before
        try:
            if grow:
                slot_file_open.reserve(fd, nbytes)
            else:
                os.ftruncate(fd, nbytes)
        except OSError as exc:
            if grow:  # a failed grow may keep what it allocated (ext4 does)
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, before)
            advice = (
                " (the disk tier's budget, disk_bytes; lower it or free space)"
                if grow and exc.errno in (errno.ENOSPC, errno.EDQUOT)
                else ""
            )
            raise OSError(
                exc.errno,
                f"cannot {'grow' if grow else 'shrink'} the disk tier file from {before} B to "
                f"{self.num_slots} slots x {self.bytes_per_slot} B{advice}: "
                f"{exc.strerror or exc}",
                self.path,
            ) from exc

    def recreate(self) -> None:
        """Replace a persistent file by a fresh, sized one (its contents are discarded).

        The lock on the old file is held until the new one is created and locked. Raises
        OSError naming the path (one that holds a directory now: not a regular file) when
        that fails; the old file is then closed, as `close()` would (a later `close()`
        returns quietly)."""
        if not self.persistent:
            raise RuntimeError("recreate() is only for a persistent slot file")
        with OPEN_LOCK:
            old, self._handle.fd = self._handle.fd, None
            try:
                slot_file_open.unlink_file(self.path)
                if old is not None:
                    free_if_unnamed(old)
                fd = slot_file_open.create_exclusive(self.path, self.mode)
                lock_or_close(fd, self.path)
                self._size_or_remove(fd)
                self._handle.fd = fd
            finally:
                if old is not None:
                    os.close(old)
        self.reused = False

    @property
    def is_open(self) -> bool:
        """Return True until `close()`."""
        return self._handle.fd is not None

    def write(self, data: memoryview, first_slot: int) -> None:
        """Write whole slots starting at `first_slot`; raise DiskIOError on any failure."""
        self._transfer(data, first_slot, is_write=True)

    def read(self, into: memoryview, first_slot: int) -> None:
        """Read whole slots starting at `first_slot` into `into`; raise DiskIOError."""
        self._transfer(into, first_slot, is_write=False)

    def _transfer(self, buf: memoryview, first_slot: int, is_write: bool) -> None:
        fd = self._handle.fd
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
        return self.status().st_size

    def status(self) -> os.stat_result:
        """Return the open file's `fstat` (owner, mode, size)."""
        fd = self._handle.fd
        if fd is None:
            raise DiskIOError(errno.EBADF, "disk tier file is closed", self.path)
        return os.fstat(fd)

    def sync(self) -> None:
        """Flush the file's data to the device (`fsync`); raise OSError naming the file."""
        fd = self._handle.fd
        if fd is None:
            return
        try:
            os.fsync(fd)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot sync the disk tier file: {exc.strerror or exc}", self.path
            ) from exc

    def sync_data(self) -> None:
        """Flush the file's written data to the device (`fdatasync`: the file's size never
        changes while it is open); raise DiskIOError naming the file."""
        fd = self._handle.fd
        if fd is None:
            raise DiskIOError(errno.EBADF, "disk tier file is closed", self.path)
        try:
            os.fdatasync(fd)
        except OSError as exc:
            raise DiskIOError(
                exc.errno, f"cannot sync the written slots: {exc.strerror or exc}", self.path
            ) from exc

    def close(self) -> None:
        """Remove the file unless it is persistent, then close it (releasing the lock only
        once the file is gone); idempotent, and what collection does without `close()`.
        Concurrent calls each return once that is done (see `CloseGate`).

        A forked child closes its copy at the fork and never removes the file. A
        file that cannot be removed (a read-only directory, an I/O error) does not raise:
        it is left, with a warning naming it and the error, and the descriptor and lock
        are released all the same (see `remove_held_file`). A close cut short by an
        interrupt (KeyboardInterrupt) still removes the file and releases both before it
        is raised (see `slot_file_handles.release`)."""
        self._closing.run(self._close_now)

    def _close_now(self) -> None:
        release(self._handle)  # before the detach: a close cut short is finished by a retry
        self._finalizer.detach()
