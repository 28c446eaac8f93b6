"""Whole-file writes: a file `kvtier replay` writes is complete or untouched."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_STANDARD_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}
_DESCRIPTOR_PATH = re.compile(r"/(?:dev/fd|proc/self/fd)/([0-9]+)")


@contextlib.contextmanager
def whole_file(path: str | Path, binary: bool = False) -> Iterator[IO[Any]]:
    """Open `path` for writing so that a failure part-way leaves no partial file.

    A regular file (or a new one) is written to a hidden temporary file beside it and
    renamed over it once the block completes; if the block raises (a full disk, Ctrl-C),
    the temporary file is removed and `path` keeps what it held. A symbolic link is
    followed (the file it names is replaced). A path naming an open descriptor
    (`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`) is written through that descriptor,
    after what this process printed to stdout and stderr, whatever it leads to (a pipe,
    or a file the shell redirected to, which is never replaced or truncated). Anything
    else that is not a regular file (a named pipe, a device) is written in place.
    """
    mode, encoding, newline = ("wb", None, None) if binary else ("w", "utf-8", "")
    descriptor = descriptor_of(path)
    if descriptor is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        with os.fdopen(os.dup(descriptor), mode, encoding=encoding, newline=newline) as file:
            yield file
        return
    target = Path(os.path.realpath(path))
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


def descriptor_of(path: str | Path) -> int | None:
    """Return the open descriptor `path` names (`/dev/stdout`, `/dev/stderr`,
    `/dev/fd/N`, `/proc/self/fd/N`), or None for any other path."""
    absolute = os.path.normpath(os.path.abspath(path))
    if absolute in _STANDARD_STREAMS:
        return _STANDARD_STREAMS[absolute]
    match = _DESCRIPTOR_PATH.fullmatch(absolute)
    return int(match.group(1)) if match else None


def _mode_of_open(target: Path) -> int:
    """Return the permission bits a plain `open(target, "w")` would leave the file with."""
    try:
        return stat.S_IMODE(target.stat().st_mode)  # an existing file keeps its own
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
