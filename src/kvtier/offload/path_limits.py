"""The longest file name and path the system takes (NAME_MAX, PATH_MAX), checked before
a path is used: `Path.exists` raises OSError (ENAMETOOLONG) on a longer one rather than
answering, and a write found it only after the work it was to keep."""

from __future__ import annotations

import os
from pathlib import Path

# Linux's limits, where the system does not say (`pathconf` answers -1 or fails).
DEFAULT_NAME_MAX = 255
DEFAULT_PATH_MAX = 4096  # the terminating null byte included


def nearest_existing(path: Path) -> Path:
    """Return `path`, or its nearest ancestor that exists: where mkdir(parents=True)
    would start creating folders (a symbolic link to nothing exists: mkdir fails there)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def path_length_problem(text: str) -> str | None:
    """Return why the path `text` is too long for the system (a name in it, or the whole
    path as given, relative paths from the current folder), or None when it is not.

    The limits are asked of the folder that exists nearest the path.
    """
    where = nearest_existing(Path(os.path.abspath(text)))
    where = where if where.is_dir() else where.parent
    name_max = _limit(where, "PC_NAME_MAX", DEFAULT_NAME_MAX)
    for name in Path(text).parts:
        size = len(os.fsencode(name))
        if name != "/" and size > name_max:
            return (
                f"the name {name[:16]}... is {size} bytes long, more than the {name_max}"
                " a file name can have here"
            )
    path_max = _limit(where, "PC_PATH_MAX", DEFAULT_PATH_MAX)
    size = len(os.fsencode(text))
    if size >= path_max:
        return f"the path is {size} bytes long, more than the {path_max - 1} a path can have here"
    return None


def _limit(folder: Path, name: str, default: int) -> int:
    """Return `os.pathconf(folder, name)`, or `default` where the system sets no limit."""
    try:
        limit = os.pathconf(folder, name)
    except (OSError, ValueError):
        return default
    return limit if limit > 0 else default
