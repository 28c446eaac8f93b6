"""The ranges of `kvtier demo`'s options, its folders and its optional dependencies,
checked without importing the engine.

`kvtier demo --turns 0`, `--out` in a read-only place or a missing matplotlib is refused
before torch is imported (about 3 s), as argparse refuses a value that is not a number.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path

from kvtier.cli.demo_plot import PLOT_NAME
from kvtier.replay.outputs import check_creates_files, file_kind, nearest_existing

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
# The `engine` extra, which the demo imports beside torch. torch is only looked up (not
# imported: that takes seconds, and comes at once, under the demo's deferred signals).
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
    if args.disk_dir is not None:
        disk_dir = Path(args.disk_dir)
        if not disk_dir.exists():  # the demo makes its temporary directory inside it
            raise ValueError(f"--disk-dir={disk_dir} does not exist")
        _check_writable_dir("--disk-dir", disk_dir)
    out = Path(args.out)
    _check_writable_dir("--out", out)
    plot = out / PLOT_NAME
    if plot.is_dir():  # the plot replaces a file there, never a folder
        raise ValueError(f"--out={out}: {plot} is a directory; the demo writes its plot there")
    if args.model_dir is not None:
        check_model_dir_is_dir(args.model_dir)


def check_model_dir_is_dir(model_dir: str) -> None:
    """Raise ValueError naming --model-dir when it is not a folder."""
    path = Path(model_dir)
    if not path.is_dir():
        state = "is not a directory" if path.exists() else "does not exist"
        raise ValueError(
            f"--model-dir={model_dir} {state} (a local HF checkpoint directory is needed)"
        )


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
    plot was drawn, after every configuration had been served. A missing torch is named
    too (a broken one fails at its import, with its own traceback).
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
    if _not_installed("torch"):
        raise ValueError(f"the demo needs torch, which is not installed: {TORCH_HINT}")


def _not_installed(name: str) -> bool:
    """Return True when no top-level module `name` can be found (it is not imported)."""
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a module in sys.modules without a spec: leave it
        return False
