"""Whole-file writes: a file `kvtier replay` writes is complete or untouched, and the
files of one run (`file_set`) are all replaced, or none."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import IO, Any

_STANDARD_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}
_DESCRIPTOR_PATH = re.compile(r"/(?:dev/fd|proc/self/fd)/([0-9]+)")
# Inside `file_set`: the (temporary file, target) pairs written, renamed when it ends.
_PENDING: ContextVar[list[tuple[str, Path]] | None] = ContextVar("pending", default=None)
TERMINATED_STATUS = 143  # 128 + SIGTERM: what a shell reports for `kill` and `timeout`


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
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: closed when the command started (`>&-`)
                stream.flush()
        with os.fdopen(os.dup(descriptor), mode, encoding=encoding, newline=newline) as file:
            yield file
        return
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with open(target, mode, encoding=encoding, newline=newline) as file:
            yield file
        return
    try:
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    except OSError as exc:  # named as the file asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    pending = _PENDING.get()
    try:
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as file:
            yield file
        os.chmod(temp, _mode_of_open(target))
        if pending is None:
            _replace(temp, target)
        else:
            pending.append((temp, target))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def file_set() -> Iterator[None]:
    """Defer the renames of the files `whole_file` writes inside the block to its end.

    If the block completes, every file is renamed into place in turn; if it raises (a
    failed write, Ctrl-C), no file is replaced and the temporary ones are removed. Files
    written through a descriptor or in place (see `whole_file`) are not deferred.
    """
    pending: list[tuple[str, Path]] = []
    token = _PENDING.set(pending)
    try:
        yield
    except BaseException:
        for temp, _ in pending:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        raise
    finally:
        _PENDING.reset(token)
    for index, (temp, target) in enumerate(pending):
        try:
            _replace(temp, target)
        except BaseException:
            for later, _ in pending[index:]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(later)
            raise


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Make SIGTERM (`kill`, `timeout`) raise SystemExit(TERMINATED_STATUS) inside the block,
    so that `whole_file` removes its temporary files; the default handler would kill the
    process on the spot and leave them. Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(TERMINATED_STATUS)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _replace(temp: str, target: Path) -> None:
    try:
        os.replace(temp, target)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(target)) from None


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
