"""The lock protocol of a disk tier's slot file: who may remove or replace the file.

An open slot file holds an exclusive, non-blocking advisory lock (`flock`) for its
lifetime. Only the holder of the lock on the file a path names may remove or replace
that file, and it does so *before* it releases the lock (closing the descriptor). A
process that takes a lock therefore holds a file that is still at its path (it owns it),
gone from it (its holder removed it: the opener starts over), or replaced there (another
opener is racing: `DiskTierBusyError`), never one that a previous holder is about to
remove.

    holder:  lock ........ unlink(path) ... close(fd) = unlock
    opener:       open(path) ........................ lock -> path names nothing: retry
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os

__all__ = [
    "DiskTierBusyError",
    "LockedFileRemovedError",
    "finish_removal",
    "is_locked",
    "lock_exclusive",
    "lock_or_close",
    "remove_held_file",
    "unlink_quietly",
]

logger = logging.getLogger(__name__)


class DiskTierBusyError(OSError):
    """The slot file is locked by another open file (another engine on the same directory
    and rank, or a second worker of this process)."""


class LockedFileRemovedError(DiskTierBusyError):
    """The file just locked is no longer at its path: its previous holder removed it before
    releasing the lock. The path is free again; opening it anew is safe."""


def lock_exclusive(fd: int, path: str) -> None:
    """Take the exclusive advisory lock of `fd` without waiting.

    Raises DiskTierBusyError if another open file holds it or `path` names another file
    (another process replaced it meanwhile), and LockedFileRemovedError if `path` names
    nothing (the holder removed the file at close); the lock is then held all the same
    and goes with `fd`.
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
        raise LockedFileRemovedError(
            errno.ENOENT,
            "disk tier file was removed by its holder while this one opened it",
            path,
        ) from None
    if (named.st_dev, named.st_ino) != (locked.st_dev, locked.st_ino):
        raise DiskTierBusyError(
            errno.EBUSY,
            "disk tier file was replaced by another process while this one opened it (two "
            "engines must not share a disk tier directory for the same rank)",
            path,
        )


def lock_or_close(fd: int, path: str) -> None:
    """Take the lock of `fd` as `lock_exclusive` does; close `fd` if that raises."""
    try:
        lock_exclusive(fd, path)
    except BaseException:
        os.close(fd)
        raise


def remove_held_file(fd: int, path: str) -> None:
    """Remove `path` if it names the file `fd` holds the lock of; call it before closing
    `fd`, so that the file is gone before the lock is released.

    Never raises an OSError: it runs in a close, which must release the lock and the
    descriptor whatever happens here. A path that names nothing or another file (removed
    or replaced by a process that ignored the lock) is left alone, and a file that cannot
    be removed (a read-only directory, an I/O error) is left in place, each with a warning
    naming the path. A file left there is stale once its lock is released: the next
    non-persistent open of the path replaces it (see `slot_file_open.create_replacing_stale`).
    A call cut short by an interrupt (KeyboardInterrupt) is finished by `finish_removal`.
    """
    try:
        if not _names_held_file(path, fd):
            logger.warning("disk tier file %s was replaced by another file; leaving it", path)
            return
        os.unlink(path)
    except FileNotFoundError:
        logger.warning("disk tier file %s vanished before shutdown", path)
    except OSError as exc:
        logger.warning(
            "cannot remove disk tier file %s (%s); leaving it, the next open of this path "
            "replaces it",
            path,
            exc.strerror or exc,
        )


def finish_removal(fd: int, path: str) -> None:
    """Finish a `remove_held_file` cut short by an interrupt, before `fd` is closed: once
    the lock is released nobody may remove the file (as large as the tier's disk budget).
    Quiet (no warning, no OSError): the call cut short may have removed it already."""
    with contextlib.suppress(OSError):
        if _names_held_file(path, fd):
            os.unlink(path)


def _names_held_file(path: str, fd: int) -> bool:
    """Return True if `path` names the file open as `fd` (a symlink is not followed);
    raise FileNotFoundError when it names nothing."""
    held = os.fstat(fd)
    named = os.lstat(path)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


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


def unlink_quietly(path: str) -> None:
    """Remove `path` (a symlink itself, never its target) if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
