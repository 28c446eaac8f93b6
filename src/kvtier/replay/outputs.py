"""Check where `kvtier replay` will write (`--json`, `--sweep --out`) before a long run.

Each check raises `ReplayError` naming the option and the path; nothing is created.
"""

from __future__ import annotations

import argparse
import errno
import os
from collections.abc import Sequence
from pathlib import Path

from kvtier.replay.config import ReplayError


def output_path(text: str) -> str:
    """Refuse an empty path (an argparse `type`): `--json "$UNSET"` would otherwise write
    nothing, or into the current folder, silently."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def check_file_path(option: str, path: Path) -> None:
    """Raise `ReplayError` unless a file can be written at `path` (its folder exists)."""
    try:
        path.stat()
    except OSError as exc:  # a new file passes: the checks below apply to its folder
        if exc.errno == errno.ELOOP:
            raise ReplayError(f"{option} {path}: a loop of symbolic links") from None
    if path.is_dir():
        raise ReplayError(f"{option} {path}: is a directory, give a file name")
    folder = path.parent
    if not folder.exists():
        raise ReplayError(f"{option} {path}: no such directory {folder}")
    if not folder.is_dir():
        raise ReplayError(f"{option} {path}: {folder} is not a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise ReplayError(f"{option} {path}: the file is not writable")
    if not path.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise ReplayError(f"{option} {path}: cannot create files in {folder}")


def check_folder_path(option: str, folder: Path, names: Sequence[str]) -> None:
    """Raise `ReplayError` unless `folder` is, or can be made, a folder to write `names` in."""
    if folder.exists():
        if not folder.is_dir():
            raise ReplayError(f"{option} {folder}: is not a directory (it is a file)")
        for name in names:
            check_file_path(option, folder / name)
        return
    ancestor = folder.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ReplayError(f"{option} {folder}: cannot create it, {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ReplayError(f"{option} {folder}: cannot create it in {ancestor}")


def check_distinct_paths(trace: Path, outputs: Sequence[tuple[str, Path]]) -> None:
    """Raise `ReplayError` when an output `(option, path)` is the trace or another output.

    Paths are compared after resolving symbolic links, and existing files by identity
    (a hard link), so no output overwrites the trace or one written before it.
    """
    written = [("the trace", trace)]
    for option, path in outputs:
        for other, other_path in written:
            if is_same_file(path, other_path):
                what = other if other == "the trace" else f"{other}'s"
                raise ReplayError(
                    f"{option} {path}: would overwrite {what} {other_path}; give another path"
                )
        written.append((option, path))


def is_same_file(a: Path, b: Path) -> bool:
    """Return True when `a` and `b` name the same file or folder (existing or not)."""
    if os.path.realpath(a) == os.path.realpath(b):  # unlike Path.resolve, no error on a loop
        return True
    return a.exists() and b.exists() and os.path.samefile(a, b)
