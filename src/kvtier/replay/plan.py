"""`kvtier replay`'s parsed options, checked into a `ReplayPlan` before the first pass.

Every check that can fail (option combinations, configurations, output paths, the trace,
a request larger than the GPU tier) runs here, so a mistake is reported before a long run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.keys import Key
from kvtier.core.plural import counted
from kvtier.replay.belady import BELADY, OFFLINE_POLICIES
from kvtier.replay.config import (
    CascadeMode,
    ReleaseOrder,
    ReplayConfig,
    ReplayError,
    TierConfig,
)
from kvtier.replay.cost import DEFAULT_LINK_GBPS, CostModel
from kvtier.replay.outputs import (
    check_distinct_paths,
    check_file_path,
    check_folder_path,
    folders_to_make,
    is_same_file,
)
from kvtier.replay.report import format_tokens
from kvtier.replay.sweep import DEFAULT_SWEEP_TOKENS, LRU
from kvtier.replay.tier_replay import record_keys
from kvtier.replay.trace import TraceRecord, read_numbered_trace

DEFAULT_OUT = "replay_out"
DEFAULT_CAPACITY = 1_000_000  # the CPU tier's tokens without --capacity (and --sweep)
SWEEP_FILES = ("sweep.csv", "sweep.png")  # what --sweep writes into --out


def build_config(args: argparse.Namespace) -> ReplayConfig:
    """Return the base replay configuration described by the parsed arguments.

    Raises `ReplayError` for options that need another one (`--cascade`, `--out`,
    `--disk-link-gbps`), rather than ignoring them.
    """
    if args.cascade and not args.disk_capacity:
        raise ReplayError(f"--cascade {args.cascade} needs a DISK tier: add --disk-capacity")
    cpu_largest = max(args.capacity or (DEFAULT_SWEEP_TOKENS if args.sweep else [DEFAULT_CAPACITY]))
    if args.cascade == CascadeMode.WRITE_THROUGH.value and 0 < args.disk_capacity < cpu_largest:
        raise ReplayError(
            f"--disk-capacity {format_tokens(args.disk_capacity)} is smaller than the CPU "
            f"capacity {format_tokens(cpu_largest)}: with --cascade write_through the disk "
            "keeps a copy of every CPU block (kvtier refuses such a config); give the disk "
            "at least the CPU capacity, or use --cascade write_back"
        )
    if args.disk_link_gbps is not None and not args.disk_capacity:
        raise ReplayError("--disk-link-gbps needs a DISK tier: add --disk-capacity")
    if args.out is not None and not args.sweep:
        raise ReplayError(
            "--out is the folder of --sweep's CSV and plot: add --sweep (or write the "
            "results with --json PATH)"
        )
    _check_capacities(args)
    tiers = [TierConfig("CPU", (args.capacity or [DEFAULT_CAPACITY])[0], args.cpu_link_gbps)]
    if args.disk_capacity:
        disk_link = args.disk_link_gbps
        if disk_link is None:
            disk_link = DEFAULT_LINK_GBPS["DISK"]
        tiers.append(TierConfig("DISK", args.disk_capacity, disk_link))
    return ReplayConfig(
        tiers=tuple(tiers),
        gpu_capacity_tokens=args.gpu_capacity,
        block_size=args.block_size,
        release_order=ReleaseOrder(args.release_order),
        cost=CostModel(args.prefill_tokens_per_s, args.bytes_per_token),
        cascade=CascadeMode(args.cascade) if args.cascade else None,
    )


def _check_capacities(args: argparse.Namespace) -> None:
    """Raise `ReplayError` naming a capacity option too small to hold one block.

    Without --capacity, a --block-size larger than the default capacity (or than the
    smallest of --sweep's) is named instead.
    """
    block = args.block_size
    if not args.capacity:
        _check_default_capacities(args)
    # Named with their aliases, as argparse names them: the user may have typed either.
    sizes = [("--capacity/--cpu", tokens) for tokens in args.capacity or []]
    sizes += [("--disk-capacity/--disk", args.disk_capacity)]
    sizes += [("--gpu-capacity", args.gpu_capacity)]
    for option, tokens in sizes:
        is_lower = option.startswith("--capacity")
        if tokens < block and (is_lower or tokens != 0):  # 0: no such tier, for the other two
            none = "" if is_lower else ", or 0 for none"
            raise ReplayError(
                f"{option} {format_tokens(tokens)} holds no {block}-token block "
                f"(--block-size {block}): give at least {counted(block, 'token')}{none}"
            )


def _check_default_capacities(args: argparse.Namespace) -> None:
    """Raise `ReplayError` naming --block-size when a default capacity holds no block."""
    block = args.block_size
    defaults = DEFAULT_SWEEP_TOKENS if args.sweep else (DEFAULT_CAPACITY,)
    if min(defaults) >= block:
        return
    smallest = format_tokens(min(defaults))
    what = f"the default --capacity {smallest}"
    if args.sweep:
        largest = format_tokens(max(defaults))
        what = f"--sweep's default capacities run {smallest} ... {largest}, and {smallest}"
    raise ReplayError(
        f"--block-size {block}: {what} holds no {block}-token block; give --capacity (at "
        f"least {block} tokens) or a smaller --block-size"
    )


@dataclass(frozen=True)
class ReplayPlan:
    """Everything `kvtier replay` runs, checked before the first pass."""

    records: list[TraceRecord]
    keys: list[list[Key]]  # the records' (`record_keys`): read_trace checked them
    base: ReplayConfig
    policies: list[str]
    capacities: list[int]
    out: Path | None  # the sweep's folder


def plan_replay(args: argparse.Namespace) -> ReplayPlan:
    """Check the options, the output paths and the trace; return what to run.

    Raises `ReplayError`, `TraceError`, `OSError` or `ValueError` with a message for the
    user, before any long work.
    """
    base = build_config(args)
    policies = list(dict.fromkeys(args.policy or [LRU]))
    for policy in policies:  # what was asked for, before the reference lines replace it
        if base.cascade and policy in OFFLINE_POLICIES:  # named as the options, not the config
            raise ReplayError(
                f"--cascade {args.cascade} works with online policies only, not --policy "
                f"{policy}: it ranks the current request's blocks, and a demotion moves "
                "another request's block"
            )
        dataclasses.replace(base, policy=policy)
    capacities = list(dict.fromkeys(args.capacity or [DEFAULT_CAPACITY]))
    if args.sweep and not args.capacity:
        capacities = list(DEFAULT_SWEEP_TOKENS)
    if args.sweep or args.json:  # the reference lines (a cascade cannot run Belady)
        references = [LRU] if base.cascade else [LRU, BELADY]
        policies = [p for p in policies if p not in (LRU, BELADY)] + references
    for capacity in capacities:  # validate every configuration before the long run
        first = TierConfig("CPU", capacity, args.cpu_link_gbps)
        dataclasses.replace(base, tiers=(first, *base.tiers[1:]))
    out_text = (args.out or DEFAULT_OUT) if args.sweep else None
    out = None if out_text is None else Path(out_text)
    _check_outputs(args, out_text)
    try:
        numbered = read_numbered_trace(args.trace, args.block_size)
    except OSError as exc:  # missing, a directory, no permission
        raise ReplayError(f"cannot read the trace {args.trace}: {exc.strerror or exc}") from None
    if base.gpu_capacity_tokens:
        _check_gpu_fits(args, numbered)
    records = [record for _, record in numbered]
    return ReplayPlan(records, record_keys(records), base, policies, capacities, out)


def _check_outputs(args: argparse.Namespace, out_text: str | None) -> None:
    """Raise `ReplayError` naming an output path (as typed) that cannot be written.

    The sweep creates its --out folder with its parents before any file is written, so
    --json may name a file in one of those folders, but not one of them.
    """
    outputs: list[tuple[str, str]] = []
    made: list[Path] = []
    out_option = "--out" if args.out is not None else "the default --out"  # not typed
    if out_text is not None:
        check_folder_path(out_option, out_text, SWEEP_FILES)
        _check_plotting()
        outputs += [(out_option, os.path.join(out_text, name)) for name in SWEEP_FILES]
        made = folders_to_make(Path(out_text))
    if args.json:
        for folder in made:
            if is_same_file(args.json, folder):
                raise ReplayError(
                    f"--json {args.json}: is a folder that {out_option} {out_text} creates; "
                    "give a file name"
                )
        check_file_path("--json", args.json, made)
        outputs.append(("--json", args.json))
    check_distinct_paths(args.trace, outputs)


def _check_plotting() -> None:
    """Raise `ReplayError` when matplotlib, which draws --sweep's plot, cannot be imported.

    It is an optional dependency (`kvtier[engine]`); found missing only when the plot is
    drawn, it cost the whole sweep and its CSV (the files are written together).
    """
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise ReplayError(
            f"--sweep draws sweep.png with matplotlib, which cannot be imported ({exc}): "
            "pip install matplotlib (or kvtier[engine])"
        ) from None


def _check_gpu_fits(args: argparse.Namespace, numbered: list[tuple[int, TraceRecord]]) -> None:
    """Raise `ReplayError` naming the trace line of a request larger than the GPU tier."""
    num_gpu_blocks = args.gpu_capacity // args.block_size
    line, largest = max(numbered, key=lambda item: len(item[1].hash_ids))
    num_blocks = len(largest.hash_ids)
    if num_blocks > num_gpu_blocks:
        raise ReplayError(
            f"{args.trace}:{line}: the request needs {num_blocks} GPU blocks "
            f"(input_length {largest.input_length}), --gpu-capacity "
            f"{format_tokens(args.gpu_capacity)} holds {num_gpu_blocks}; raise it to at "
            f"least {num_blocks * args.block_size} tokens"
        )
