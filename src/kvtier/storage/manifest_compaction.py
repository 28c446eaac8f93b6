"""Compaction of a manifest (see `manifest`): when to do it, and the atomic rewrite.

A compaction replaces the manifest with its header and one put record per live slot. The
new content goes to `<manifest>.tmp` in the same directory, is fsynced, and is renamed
over the manifest, after which the directory is fsynced (by `rewrite_manifest` with
`durable_rename`, else by its caller, `ManifestLog`, which tries again before it relies
on the rename): at every instant the file at the manifest path is either the complete
old log or the complete new one. A leftover `.tmp` (a crash between writing it and the
rename) is never read; the next rewrite removes it.
"""

from __future__ import annotations

import errno
import os

from kvtier.storage.file_lock import unlink_quietly

__all__ = [
    "COMPACT_FLOOR",
    "COMPACT_RATIO",
    "compaction_due",
    "rewrite_manifest",
    "sync_directory",
]

COMPACT_RATIO = 4  # compact when the log holds more than this many records per live slot
COMPACT_FLOOR = 4096  # ... and more than this many records (~256 KiB with 36-byte keys)


def compaction_due(records: int, live: int, floor: int = COMPACT_FLOOR) -> bool:
    """Return True when a log of `records` records describing `live` live slots should be
    compacted: it holds more than `COMPACT_RATIO` records per live slot and more than
    `floor` records.

    The ratio bounds the file at about `COMPACT_RATIO` times its compacted size and makes
    the cost of rewriting amortized O(1) per appended record (each compaction rewrites at
    most a `1 / COMPACT_RATIO` share of the records appended since the last one); the
    floor keeps a small cache from rewriting its manifest every few stores.
    """
    return records > max(COMPACT_RATIO * live, floor)


def rewrite_manifest(path: str, content: bytes, *, durable_rename: bool = False) -> int:
    """Atomically replace the file at `path` with `content`; return a descriptor that
    appends to the new file (O_APPEND, the one the content was written through).

    Raises OSError naming the file (after removing the temporary file) when the content
    cannot be written, synced or renamed; the file at `path` is then unchanged. The
    temporary file is created exclusively (never opened when something is already there),
    so nothing at its path can make this wait. Without `durable_rename` the directory is
    not synced: the new file is complete and in place, and should the rename be lost in a
    crash the old log is back, which is consistent too (a compaction keeps every live
    record) until a record appended to the new file must be durable; the caller syncs the
    directory (`sync_directory`) before that. With `durable_rename` (the old log must
    never come back) the directory is synced here, and when that fails OSError naming
    the file is raised; the new file is then in place.
    """
    tmp = path + ".tmp"
    unlink_quietly(tmp)  # a leftover of a crash; the slot file's lock makes it ours
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        _write_all(fd, content, tmp)
        os.replace(tmp, path)  # its OSError names both paths
    except BaseException:
        os.close(fd)
        unlink_quietly(tmp)
        raise
    if not durable_rename:
        return fd
    try:
        sync_directory(path)
    except OSError as exc:
        os.close(fd)
        raise OSError(
            exc.errno, f"cannot sync the new manifest's directory: {exc.strerror or exc}", path
        ) from exc
    return fd


def sync_directory(path: str) -> None:
    """Make the directory entry of `path` (a rename to it, or its removal) durable: fsync
    the directory holding it; raise OSError when that fails."""
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_all(fd: int, content: bytes, path: str) -> None:
    """Write `content` to `fd` and fsync it; raise OSError naming `path` on failure."""
    try:
        view = memoryview(content)
        while view:
            written = os.write(fd, view)
            if written <= 0:  # never spin on a write that makes no progress
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[written:]
        os.fsync(fd)
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot write the new manifest: {exc.strerror or exc}", path
        ) from exc
