"""Whole-file writes: a file `kvtier replay` writes is complete or untouched, and the
files of one run (`file_set`) are all replaced, or none."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import IO, Any

from kvtier.replay.signals import signals_deferred

_STANDARD_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}
_DESCRIPTOR_PATH = re.compile(r"/(?:dev/fd|proc/self/fd)/([0-9]+)")
_MAX_LINKS = 40  # symbolic links followed to a descriptor's name, as the kernel does
# Inside `file_set`: the (temporary file, target) pairs written, renamed when it ends.
_PENDING: ContextVar[list[tuple[str, Path]] | None] = ContextVar("pending", default=None)


@contextlib.contextmanager
def whole_file(path: str | Path, binary: bool = False) -> Iterator[IO[Any]]:
    """Open `path` for writing so that a failure part-way leaves no partial file.

    A regular file (or a new one) is written to a hidden temporary file beside it and
    renamed over it once the block completes; if the block raises (a full disk, Ctrl-C),
    the temporary file is removed and `path` keeps what it held. A symbolic link is
    followed (the file it names is replaced). A path naming an open descriptor
    (`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`, or a symbolic link to one) is
    written through that descriptor, after what this process printed to stdout and
    stderr, whatever it leads to (a pipe, or a file the shell redirected to, which is
    never replaced or truncated). Anything else that is not a regular file (a named
    pipe, a device) is written in place.
    """
    mode, encoding, newline = ("wb", None, None) if binary else ("w", "utf-8", "")
    descriptor = descriptor_of(path)
    if descriptor is not None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: closed when the command started (`>&-`)
                stream.flush()
        with (
            _named(path),
            os.fdopen(os.dup(descriptor), mode, encoding=encoding, newline=newline) as file,
        ):
            yield file
        return
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with _named(path), open(target, mode, encoding=encoding, newline=newline) as file:
            yield file
        return
    pending = _PENDING.get()
    temp: str | None = None
    try:
        with signals_deferred():  # no signal between creating the file and owning it
            fd, temp = _temporary_file_beside(target, path)
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as file:
            yield file
        os.chmod(temp, _mode_of_open(target))
        if pending is None:
            _replace(temp, target)
        else:
            pending.append((temp, target))
    except BaseException as exc:
        if temp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        if isinstance(exc, OSError) and exc.filename is None:  # a full disk: name the file
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


@contextlib.contextmanager
def _named(path: str | Path) -> Iterator[None]:
    """Name `path` in an OSError that names no file (`/dev/full`: a full device)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def _temporary_file_beside(target: Path, path: str | Path) -> tuple[int, str]:
    """Create the hidden temporary file `whole_file` writes `target` through."""
    try:
        return tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    except OSError as exc:  # named as the file asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None


@contextlib.contextmanager
def file_set() -> Iterator[None]:
    """Defer the renames of the files `whole_file` writes inside the block to its end.

    If the block completes, every file is renamed into place in turn; if it raises (a
    failed write, Ctrl-C), no file is replaced and the temporary ones are removed. Files
    written through a descriptor or in place (see `whole_file`) are not deferred.
    """
    pending: list[tuple[str, Path]] = []
    token = _PENDING.set(pending)
    completed = False
    try:
        yield
        completed = True
    finally:
        held = False
        try:
            with signals_deferred():  # Ctrl-C waits for the last rename: no half-replaced set
                held = True
                try:
                    while completed and pending:
                        _replace(*pending[0])
                        del pending[0]
                finally:
                    _discard(pending)
        finally:
            _PENDING.reset(token)
            if not held:  # a signal came before the hold began
                _discard(pending)


def _discard(pending: list[tuple[str, Path]]) -> None:
    """Remove the temporary files not renamed (the block or a rename failed, or Ctrl-C)."""
    while pending:
        temp, _ = pending.pop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _replace(temp: str, target: Path) -> None:
    try:
        os.replace(temp, target)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(target)) from None


def written_in_place(path: str | Path) -> bool:
    """Return True when `whole_file` writes `path` as it goes (an open descriptor, a named
    pipe, a device), not through a temporary file that `file_set` can hold back."""
    if descriptor_of(path) is not None:
        return True
    target = Path(os.path.realpath(path))
    return target.exists() and not target.is_file()


def descriptor_of(path: str | Path) -> int | None:
    """Return the open descriptor `path` names (`/dev/stdout`, `/dev/stderr`,
    `/dev/fd/N`, `/proc/self/fd/N`), or None for any other path.

    A symbolic link to one of them names it too (`ln -s /dev/stdout r.json`): resolved
    whole, it would name what the descriptor leads to (a file the shell redirected to,
    which a write would replace, or a pipe's name in /proc, where no file can be made).
    """
    name = os.fspath(path)
    for _ in range(_MAX_LINKS):
        absolute = os.path.normpath(os.path.abspath(name))
        if absolute in _STANDARD_STREAMS:
            return _STANDARD_STREAMS[absolute]
        match = _DESCRIPTOR_PATH.fullmatch(absolute)
        if match:
            return int(match.group(1))
        try:
            link = os.readlink(absolute)
        except OSError:  # not a symbolic link, or nothing there
            return None
        # a relative target counts from the folder the link is really in
        name = os.path.join(os.path.realpath(os.path.dirname(absolute)), link)
    return None  # a loop of links: the checks report it


def _mode_of_open(target: Path) -> int:
    """Return the permission bits a plain `open(target, "w")` would leave the file with."""
    try:
        return stat.S_IMODE(target.stat().st_mode)  # an existing file keeps its own
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
