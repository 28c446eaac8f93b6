"""Check where `kvtier replay` will write (`--json`, `--sweep --out`) before a long run.

Each check raises `ReplayError` naming the option and the path. Whether a folder takes
new files is found by creating (and removing at once) an empty hidden file in it, as the
write will: permission bits alone do not tell for root, nor for /proc or /sys.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvtier.offload.path_limits import nearest_existing, path_length_problem
from kvtier.replay.config import ReplayError
from kvtier.replay.signals import signals_deferred
from kvtier.replay.whole_file import descriptor_of


def output_path(text: str) -> str:
    """Refuse an empty path (an argparse `type`): `--json "$UNSET"` would otherwise write
    nothing, or into the current folder, silently."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def json_output_path(text: str) -> str:
    """`output_path`, with `-` naming stdout (`/dev/stdout`) as the trace's `-` names stdin
    (`kvtier replay --json -`, `kvtier generate -`)."""
    return "/dev/stdout" if text == "-" else output_path(text)


def folder_output_path(text: str) -> str:
    """`output_path` for `--out`, refusing `-`: where `--json -` writes to stdout, a sweep
    writes two files into a folder, which stdout cannot be (`./-` names a folder `-`)."""
    if text == "-":
        raise argparse.ArgumentTypeError(
            "- would be stdout, but --sweep writes two files (sweep.csv, sweep.png) into a "
            "folder: give a folder path (./- for a folder named -)"
        )
    return output_path(text)


def shell_word(path: str) -> str:
    """Return `path` as a user can paste it into a shell command: with `./` before a
    relative path starting with `-` (`-/sweep.csv`), which a command reads as an option."""
    return f"./{path}" if path.startswith("-") else path


def check_file_path(option: str, text: str, made: Sequence[Path] = ()) -> None:
    """Raise `ReplayError` unless a file can be written at `text` (its folder exists).

    `text` is the path as the user typed it, and the messages name it so. A path that
    can only name a folder (`d/`, `d/.`) is refused, as the shell refuses `> d/`. `made`
    are the folders the command creates before it writes the file (`--out` and its new
    parents, see `folders_to_make`): the file may go in one of them.
    """
    check_name_lengths(f"{option} {text}", text)
    path = Path(text)
    if names_a_folder(text) and not path.is_dir():
        if path.exists():  # `t.jsonl/`: the folder it names is a file
            ending = "/" if text.endswith("/") else f"/{os.path.basename(text)}"
            named = text.rstrip("/") if ending == "/" else text[: -len(ending)]
            kind = file_kind(path)
            raise ReplayError(f"{option} {text}: ends in {ending} but {named} is {kind}")
        raise ReplayError(f"{option} {text}: names a directory, give a file name")
    in_made = any(is_same_file(path.parent, folder) for folder in made)
    if in_made and _steps_out_of_folders(path.parent, made):
        return  # `check_folder_path` checked that the folders can be created
    descriptor = descriptor_of(path)
    if descriptor is not None:
        _check_descriptor(option, text, descriptor)
        return
    try:
        path.stat()
    except OSError as exc:  # a new file passes: the checks below apply to its folder
        if exc.errno == errno.ELOOP:
            raise ReplayError(f"{option} {text}: a loop of symbolic links") from None
    if path.is_dir():
        raise ReplayError(f"{option} {text}: is a directory, give a file name")
    folder = path.parent
    if not folder.exists():
        raise ReplayError(f"{option} {text}: no such directory {folder}")
    if not folder.is_dir():
        raise ReplayError(f"{option} {text}: {folder} is not a directory")
    if path.exists() and not os.access(path, os.W_OK):  # root may replace it: the shell would
        raise ReplayError(f"{option} {text}: the file is not writable")
    if path.exists() and not path.is_file():  # a named pipe or a device, written in place
        return
    target = Path(os.path.realpath(path))  # a symbolic link: the file it names is replaced
    check_creates_files(f"{option} {text}", target.parent)


def check_name_lengths(what: str, text: str) -> None:
    """Raise `ReplayError` (starting with `what`) when a name in the path `text`, or the
    whole path, is longer than the system takes (ENAMETOOLONG): found before the run, not
    when writing after it (and before `Path.exists`, which raises OSError then)."""
    problem = path_length_problem(text)
    if problem is not None:
        raise ReplayError(f"{what}: {problem}")


def _steps_out_of_folders(folder: Path, made: Sequence[Path]) -> bool:
    """Return True when each folder that `folder` (as typed) leaves by `..` exists or is
    one of `made`: the system, as a shell's `> new/a/../r.json`, needs `new/a` there,
    though `realpath` (which `is_same_file` compares) reads it as `new`."""
    parts = folder.parts
    for i, part in enumerate(parts):
        left = Path(*parts[:i])
        if part == ".." and not left.is_dir() and not any(is_same_file(left, f) for f in made):
            return False
    return True


def names_a_folder(text: str) -> bool:
    """Return True when the path `text` can only name a folder: it ends in `/`, or its
    last part is `.` or `..` (`Path` drops a trailing `/` and a `/.`)."""
    return text.endswith("/") or os.path.basename(text) in (".", "..")


def _check_descriptor(option: str, path: str, descriptor: int) -> None:
    """Raise `ReplayError` unless `descriptor` is open for writing."""
    try:
        flags = fcntl.fcntl(descriptor, fcntl.F_GETFL)
    except OSError:
        raise ReplayError(f"{option} {path}: descriptor {descriptor} is not open") from None
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise ReplayError(f"{option} {path}: descriptor {descriptor} is open for reading only")


def check_creates_files(what: str, folder: Path) -> None:
    """Raise `ReplayError` (starting with `what`) unless a file can be created in `folder`."""
    with signals_deferred():  # no probe file left behind by Ctrl-C
        try:
            # Named as `prepare_host`'s probe (with the pid), which removes one a dead
            # process left in a disk tier's directory, never a live one's.
            fd, probe = tempfile.mkstemp(dir=folder, prefix=f".kvtier-probe-{os.getpid()}-")
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ReplayError(f"{what}: cannot create files in {folder} ({reason})") from None
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):  # removed by another host's check
            os.unlink(probe)


def folders_to_make(folder: Path) -> list[Path]:
    """Return the folders mkdir(parents=True) creates for `folder`, deepest first."""
    return [f for f in (folder, *folder.parents) if not f.exists()]


def check_folder_path(option: str, text: str, names: Sequence[str]) -> None:
    """Raise `ReplayError` unless the folder `text` (as typed) is, or can be made, a folder
    to write `names` in."""
    check_name_lengths(f"{option} {text}", text)
    folder = Path(text)
    if folder.exists():
        if not folder.is_dir():
            raise ReplayError(f"{option} {text}: is not a directory (it is {file_kind(folder)})")
        for name in names:
            check_file_path(option, os.path.join(text, name))
        return
    ancestor = nearest_existing(folder)
    if ancestor.is_symlink() and not ancestor.exists():
        why = "a loop of symbolic links" if _is_a_loop(ancestor) else "which does not exist"
        raise ReplayError(
            f"{option} {text}: cannot create it, {ancestor} is a symbolic link to "
            f"{os.readlink(ancestor)}, {why}"
        )
    if not ancestor.is_dir():
        raise ReplayError(f"{option} {text}: cannot create it, {ancestor} is not a directory")
    check_creates_files(f"{option} {text}", ancestor)


def _is_a_loop(path: Path) -> bool:
    """Return True when following the symbolic links of `path` goes round (ELOOP)."""
    try:
        path.stat()
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def file_kind(path: Path) -> str:
    """Return what `path`, which exists and is no folder, is: "a file", "a named pipe"..."""
    mode = path.stat().st_mode
    kinds = [
        (stat.S_ISREG, "a file"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((name for is_kind, name in kinds if is_kind(mode)), "another kind of file")


def check_distinct_paths(trace: str, outputs: Sequence[tuple[str, str]]) -> None:
    """Raise `ReplayError` when an output `(option, path)` is the trace or another output
    (each path as typed).

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


def is_same_file(a: str | Path, b: str | Path) -> bool:
    """Return True when `a` and `b` name the same file or folder (existing or not)."""
    if os.path.realpath(a) == os.path.realpath(b):  # unlike Path.resolve, no error on a loop
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
