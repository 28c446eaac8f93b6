"""Whole-file writes: a file `kvtier replay` writes is complete or untouched."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def whole_file(path: str | Path, binary: bool = False) -> Iterator[IO[Any]]:
    """Open `path` for writing so that a failure part-way leaves no partial file.

    A regular file (or a new one) is written to a hidden temporary file beside it and
    renamed over it once the block completes; if the block raises (a full disk, Ctrl-C),
    the temporary file is removed and `path` keeps what it held. A symbolic link is
    followed (the file it names is replaced). Anything else (`/dev/stdout`, a pipe) is
    written in place.
    """
    target = Path(os.path.realpath(path))
    mode, encoding, newline = ("wb", None, None) if binary else ("w", "utf-8", "")
    if target.exists() and not target.is_file():
        with open(target, mode, encoding=encoding, newline=newline) as file:
            yield file
        return
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as file:
            yield file
        os.chmod(temp, _mode_of_open(target))
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _mode_of_open(target: Path) -> int:
    """Return the permission bits a plain `open(target, "w")` would leave the file with."""
    try:
        return stat.S_IMODE(target.stat().st_mode)  # an existing file keeps its own
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
