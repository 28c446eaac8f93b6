"""The open slot files of this process (see `slot_file`): the handle of each, which its
`SlotFile`'s finalizer releases, the list a forked child closes its inherited copies by,
and the release itself (remove the file unless it is persistent, then close it)."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass, field

from kvtier.storage.file_lock import finish_removal, remove_held_file

__all__ = ["OPEN_FILES", "OPEN_LOCK", "OpenFile", "free_if_unnamed", "release", "release_dropped"]


@dataclass(slots=True)
class OpenFile:
    """What a `SlotFile`'s finalizer releases: shared with it so that the finalizer never
    holds the `SlotFile` itself. `fd` is None once closed."""

    path: str
    persistent: bool
    fd: int | None = None
    owner_pid: int = field(default_factory=os.getpid)  # the process that opened it


# The open files of this process, by id of their handle: a forked child closes its copies
# at once (`_close_in_child`), or one that outlived its parent would hold the lock and the
# next engine's open of the path would fail as busy. `OPEN_LOCK` is held while a
# descriptor is opened or closed and across `fork`, so no child inherits one unlisted.
# Reentrant: a finalizer may close a file in a thread that is opening another.
OPEN_FILES: dict[int, OpenFile] = {}
OPEN_LOCK = threading.RLock()


def free_if_unnamed(fd: int) -> None:
    """Give back the space of an unlinked file now, not when `fd` closes (a new file may
    need it), unless another name still holds it (a hard link: a backup's copy)."""
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_nlink == 0:
            os.ftruncate(fd, 0)


def _close_in_child() -> None:
    """Close every slot file inherited through `fork` (the parent's lock stays held)."""
    for handle in OPEN_FILES.values():
        fd, handle.fd = handle.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    OPEN_FILES.clear()
    OPEN_LOCK.release()


os.register_at_fork(
    before=OPEN_LOCK.acquire, after_in_parent=OPEN_LOCK.release, after_in_child=_close_in_child
)


def release(handle: OpenFile) -> None:
    """Close the file of `handle`, first removing it unless it is persistent; an interrupt
    (KeyboardInterrupt) in the removal is raised once it is finished and the file closed:
    a retried close finds nothing to do, and nobody may remove the file once unlocked."""
    with OPEN_LOCK:
        removes = not handle.persistent and os.getpid() == handle.owner_pid
        OPEN_FILES.pop(id(handle), None)
        # No call from here to the `try`: CPython raises a Ctrl-C at calls (and at function
        # entries and loops), so it cannot lose the descriptor in between.
        fd, handle.fd = handle.fd, None
        if fd is None:
            return
        try:
            if removes:
                remove_held_file(fd, handle.path)  # under the lock: see `file_lock`
        except BaseException:
            if removes:
                finish_removal(fd, handle.path)
            raise
        finally:
            os.close(fd)


def release_dropped(handle: OpenFile) -> None:
    """Release the file of a `SlotFile` collected without `close()`, then warn."""
    was_open = handle.fd is not None
    release(handle)
    if was_open:
        warnings.warn(
            f"disk tier file {handle.path} was not closed; closed it at collection",
            ResourceWarning,
            stacklevel=2,
        )
