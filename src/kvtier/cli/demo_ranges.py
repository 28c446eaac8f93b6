"""The ranges of `kvtier demo`'s options, its folders and its optional dependencies,
checked without importing the engine.

`kvtier demo --turns 0`, `--out` in a read-only place or a missing matplotlib is refused
before torch is imported (about 3 s), as argparse refuses a value that is not a number.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import tempfile
from pathlib import Path

from kvtier.cli.demo_plot import PLOT_NAME
from kvtier.offload.path_limits import nearest_existing
from kvtier.replay.outputs import check_creates_files, check_name_lengths, file_kind

# The least value of each numeric option (message lengths may be 0, not all of them).
OPTION_MINIMUMS = {
    "conversations": 1,
    "turns": 1,
    "system_tokens": 0,
    "document_tokens": 0,
    "user_tokens": 0,
    "answer_tokens": 1,
    "gpu_blocks": 2,
    "block_size": 1,
    "cpu_mib": 1,
    "disk_mib": 1,
    "cascade_cpu_mib": 1,
}
# The `engine` extra, which the demo imports beside torch. torch is not looked up: its
# import comes at once (under the demo's deferred signals; a missing torch is named there).
ENGINE_MODULES = ("safetensors", "matplotlib")
# torch is no dependency of kvtier's: the README has the user install the build they
# want first (a bare `pip install torch` pulls the CUDA one on Linux).
TORCH_HINT = (
    "install the torch build you want first, e.g. the CPU one: pip install torch "
    "--index-url https://download.pytorch.org/whl/cpu"
)
# The most turns (conversations x turns) one run serves: every configuration serves each
# one as a request on the CPU engine, and every conversation's history is held at once.
MAX_TURNS = 10_000


def check_options(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first option out of range."""
    for option, least in OPTION_MINIMUMS.items():
        value = getattr(args, option)
        if value < least:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.conversations * args.turns > MAX_TURNS:
        raise ValueError(
            f"--conversations={args.conversations} x --turns={args.turns} is "
            f"{args.conversations * args.turns} turns; the demo serves at most {MAX_TURNS} per"
            " configuration (each is a request on the CPU engine, in every configuration)"
        )
    if args.system_tokens + args.document_tokens + args.user_tokens == 0:
        raise ValueError(
            "--system-tokens, --document-tokens and --user-tokens are all 0: the first"
            " prompt would be empty"
        )
    if args.cascade == "write_through" and args.cascade_cpu_mib > args.disk_mib:
        raise ValueError(
            f"--cascade-cpu-mib={args.cascade_cpu_mib} is larger than --disk-mib="
            f"{args.disk_mib}: with --cascade write_through the disk keeps a copy of every"
            " CPU block; raise --disk-mib, lower --cascade-cpu-mib, or use --cascade write_back"
        )


def check_dirs(args: argparse.Namespace) -> None:
    """Raise ValueError when --disk-dir or --out cannot hold the demo's files (the plot's
    path in --out a folder too), or --model-dir is not a folder (its contents are checked
    with the engine imported)."""
    for flag in ("--disk-dir", "--out", "--model-dir"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:  # before Path.exists, which raises OSError on such a name
            check_name_lengths(f"{flag}={value}", value)
    if args.disk_dir is not None:
        disk_dir = Path(args.disk_dir)
        if not disk_dir.exists():  # the demo makes its temporary directory inside it
            raise ValueError(f"--disk-dir={disk_dir} {_missing(disk_dir)}")
        _check_writable_dir("--disk-dir", disk_dir)
    if args.disk_io == "direct":
        _check_direct_io(args.disk_dir)
    out = Path(args.out)
    _check_writable_dir("--out", out)
    plot = out / PLOT_NAME
    if plot.is_dir():  # the plot replaces a file there, never a folder
        raise ValueError(f"--out={out}: {plot} is a directory; the demo writes its plot there")
    if args.model_dir is not None:
        check_model_dir_is_dir(args.model_dir)


def _check_direct_io(disk_dir: str | None) -> None:
    """Raise ValueError when the filesystem of the disk tier's folder (--disk-dir, else
    the temp dir the demo makes its folder in) refuses O_DIRECT.

    Unchecked, it was found when the disk tier run opened its file, after the runs before
    it had been served. A file is created there and opened with O_DIRECT, as the tier
    opens its own; any other failure is left to the run, which names it.
    """
    direct = getattr(os, "O_DIRECT", 0)
    folder = disk_dir if disk_dir is not None else tempfile.gettempdir()
    if not direct or not os.path.isdir(folder):
        return
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kvtier-direct-io-")
    except OSError:
        return
    os.close(fd)
    try:
        os.close(os.open(probe, os.O_RDONLY | direct | os.O_CLOEXEC))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            where = f"--disk-dir={disk_dir}" if disk_dir is not None else f"the temp dir {folder}"
            raise ValueError(
                f"--disk-io=direct: the filesystem of {where} refused O_DIRECT (it has no "
                "direct I/O, e.g. tmpfs before Linux 6.6): use --disk-io page_cache, or a "
                "--disk-dir on a block device"
            ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def check_model_dir_is_dir(model_dir: str) -> None:
    """Raise ValueError naming --model-dir when it is not a folder."""
    path = Path(model_dir)
    if not path.is_dir():
        state = "is not a directory" if path.exists() else _missing(path)
        raise ValueError(
            f"--model-dir={model_dir} {state} (a local HF checkpoint directory is needed)"
        )


def _missing(path: Path) -> str:
    """Say that `path` does not exist, naming the part of it that is no folder (`afile` in
    `afile/sub`): "does not exist" alone sent the user looking for a missing folder."""
    ancestor = nearest_existing(path)
    if ancestor != path and ancestor.exists() and not ancestor.is_dir():
        return f"does not exist: {ancestor} is {file_kind(ancestor)}, not a directory"
    return "does not exist"


def _check_writable_dir(flag: str, path: Path) -> None:
    """Raise ValueError unless `path` is, or mkdir(parents=True) can make, a writable folder."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}={path} is {file_kind(path)}, not a directory")
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(f"{flag}={path} cannot be created: {existing} is not a directory")
    check_creates_files(f"{flag}={path}", existing)  # raises ReplayError, a ValueError


def check_dependencies() -> None:
    """Raise ValueError naming the `engine` extra's modules that cannot be imported.

    Imported here, before torch: a missing or broken matplotlib was found only when the
    plot was drawn, after every configuration had been served.
    """
    failed = []
    for name in ENGINE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a broken install may raise more than ImportError
            failed.append(f"{name} ({exc})")
    if failed:
        raise ValueError(
            f"the demo needs {', '.join(failed)}, which cannot be imported: "
            "pip install 'kvtier[engine]'"
        )
