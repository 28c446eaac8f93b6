"""The options of `kvtier demo`, without importing the engine.

`kvtier --help` and `kvtier replay` build every subcommand's parser; the demo itself
(torch, the reference engine) is imported only when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvtier.cli.demo_ranges import (
    OPTION_MINIMUMS,
    TORCH_HINT,
    check_dependencies,
    check_dirs,
    check_options,
)
from kvtier.offload.config import CascadeMode, DiskIOMode
from kvtier.replay.ascii_number import ascii_int
from kvtier.replay.outputs import output_path
from kvtier.replay.signals import signals_deferred
from kvtier.replay.store_once import StoreOnce

# The workload and tier sizes: (option, default, what it sets).
_SIZE_OPTIONS = (
    ("--conversations", 8, "conversations"),
    ("--turns", 6, "turns per conversation; conversations x turns <= 10000"),
    ("--system-tokens", 256, "tokens of the shared system prompt"),
    ("--document-tokens", 512, "tokens of each conversation's document"),
    ("--user-tokens", 64, "tokens per user message"),
    ("--answer-tokens", 16, "tokens per answer"),
    ("--gpu-blocks", 96, "GPU pool size in blocks, the null block included"),
    ("--block-size", 16, "tokens per block"),
    ("--cpu-mib", 256, "CPU tier size in MiB"),
    ("--disk-mib", 256, "disk tier size in MiB"),
)


def add_parser(subparsers: Any) -> None:
    """Register `kvtier demo`."""
    parser = subparsers.add_parser(
        "demo",
        help="multi-turn chat on the reference engine: offload off, CPU, disk, CPU+disk",
        description=(
            "Serve interleaved multi-turn conversations that share a system prompt on the "
            "reference engine, with a GPU pool too small to keep their histories. Runs the "
            "workload with offload off, through the CPU tier, the disk tier, and a small CPU "
            "tier in front of the disk tier (the cascade); "
            "prints TTFT, throughput and tokens served per tier, plots TTFT per turn, and "
            "checks that every configuration produced identical tokens."
        ),
    )
    # Every option takes one value (StoreOnce): a repeat is a usage error naming it, not a
    # silent last-one-wins (`--turns 2 ... --turns 20` from a copied command line).
    parser.add_argument(
        "--model-dir",
        action=StoreOnce,
        type=output_path,
        help="local HF checkpoint dir (default: random demo model)",
    )
    for flag, default, what in _SIZE_OPTIONS:
        parser.add_argument(
            flag,
            action=StoreOnce,
            type=ascii_int,
            default=default,
            help=f"{what} (at least {OPTION_MINIMUMS[flag[2:].replace('-', '_')]}; "
            "default %(default)s)",
        )
    parser.add_argument(
        "--cascade-cpu-mib",
        action=StoreOnce,
        type=ascii_int,
        default=32,
        help="CPU tier size in front of the disk tier in the CPU+disk run (MiB, at least "
        f"{OPTION_MINIMUMS['cascade_cpu_mib']}; default 32: "
        "smaller than the demo's KV, so CPU evictions are demoted and served from disk)",
    )
    parser.add_argument(
        "--cascade",
        action=StoreOnce,
        choices=[m.value for m in CascadeMode],
        default=CascadeMode.WRITE_THROUGH.value,
        help="how CPU blocks reach the disk: write_through (copy every block at once) or "
        "write_back (copy a block when the CPU tier is about to evict it); default %(default)s",
    )
    parser.add_argument(
        "--disk-dir",
        action=StoreOnce,
        type=output_path,
        help="directory for the disk tier file (default: a temp dir)",
    )
    parser.add_argument(
        "--disk-io",
        action=StoreOnce,
        choices=[m.value for m in DiskIOMode],
        default=DiskIOMode.DIRECT.value,
        help="how the disk tier reads and writes: direct (O_DIRECT, past the page cache; a "
        "block must be a multiple of 4096 bytes) or page_cache (buffered); default direct",
    )
    parser.add_argument(
        "--out",
        action=StoreOnce,
        type=_plot_folder,
        default="out",
        help="folder for the plot (default ./out)",
    )
    parser.set_defaults(run=_run_demo)


def _plot_folder(text: str) -> str:
    """`output_path` for `--out`, refusing `-`: the plot goes into a folder, and `-` reads
    as stdout elsewhere in kvtier (`./-` names a folder `-`)."""
    if text == "-":
        raise argparse.ArgumentTypeError(
            "- would be stdout, but the demo writes its plot into a folder: give a folder "
            "path (./- for a folder named -)"
        )
    return output_path(text)


def _run_demo(args: argparse.Namespace) -> int:
    """Import the demo (torch and the engine) and run it.

    Ctrl-C and SIGTERM wait for the import (about a second): torch swallows any
    exception raised while it imports numpy, so a KeyboardInterrupt raised there was
    lost, and the demo ran on to its end with numpy half imported (its disk and CPU
    stores failed, and it exited 0 or with matplotlib's traceback).
    """
    try:  # before the import: a value out of range is refused at once, not after it
        check_options(args)
        check_dirs(args)
        check_dependencies()
    except ValueError as exc:
        print(f"kvtier demo: error: {exc}", file=sys.stderr)
        return 2
    quiet_openmp_waits()
    with signals_deferred():
        try:
            from kvtier.cli.demo import run_demo
        except ModuleNotFoundError as exc:  # torch is installed apart from kvtier (README)
            if exc.name != "torch":  # a broken install's traceback says more
                raise
            print(f"kvtier demo: error: the demo needs torch: {TORCH_HINT}", file=sys.stderr)
            return 2

    return run_demo(args)


def quiet_openmp_waits() -> None:
    """Make torch's OpenMP threads sleep, not spin, between kernels, unless the user set
    `OMP_WAIT_POLICY`; read once, when torch loads OpenMP, so before torch is imported.

    The tiny demo model's kernels are short: between two, the team's threads spin on a
    core. With other processes running, a spinning thread holds a core another thread of
    the team needs, and the demo slowed up to 8x (2 cores, two busy processes besides:
    73 s spinning, 38 s sleeping, for a 4-conversation demo that takes 18 s on an idle
    machine either way).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
