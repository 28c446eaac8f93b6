"""`kvtier replay TRACE`: replay a Mooncake-format trace through kvtier's tiers.

`main(argv)` is the command; `add_parser(subparsers)` mounts it under `kvtier`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES, PolicySpec
from kvtier.replay.belady import BELADY, OFFLINE_POLICIES
from kvtier.replay.config import (
    CascadeMode,
    ReleaseOrder,
    ReplayConfig,
    ReplayError,
    TierConfig,
)
from kvtier.replay.cost import DEFAULT_LINK_GBPS, CostModel
from kvtier.replay.sweep import (
    DEFAULT_SWEEP_TOKENS,
    LRU,
    SweepPoint,
    hit_ratio_table,
    plot_sweep,
    point_row,
    run_sweep,
    write_csv,
    write_json,
)
from kvtier.replay.trace import DEFAULT_BLOCK_SIZE, TraceError, read_trace, summarize

_SUFFIXES = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)\s*$", re.IGNORECASE)


def parse_tokens(text: str) -> int:
    """Parse a token count like `300k`, `1M`, `1.5M` or `2000000`."""
    match = _CAPACITY.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid token count {text!r}: use e.g. 300k, 1M, 1.5M or 2000000"
        )
    value = float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    return round(value)


def format_tokens(num_tokens: int) -> str:
    """Return `num_tokens` as 300k / 1M / 1.5M."""
    for suffix, unit in (("M", 1_000_000), ("k", 1_000)):
        if num_tokens >= unit:
            return f"{num_tokens / unit:g}{suffix}"
    return str(num_tokens)


def _policy_name(text: str) -> str:
    if text.strip().lower() in OFFLINE_POLICIES:
        return text.strip().lower()
    try:
        return PolicySpec.parse(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the replay options to `parser`."""
    parser.add_argument("trace", help="Mooncake-format .jsonl trace")
    parser.add_argument(
        "--policy",
        action="append",
        type=_policy_name,
        metavar="NAME",
        help="lower-tier policy EVICTION[+ADMISSION], repeatable (default: lru). "
        f"Eviction: {', '.join(EVICTION_POLICIES)}; admission: "
        f"{', '.join(a for a in ADMISSION_POLICIES if a != 'all')}; or offline: 'belady' "
        "(the optimum), 'oracle-lfu' (evicts the block with the fewest uses left)",
    )
    parser.add_argument(
        "--capacity",
        "--cpu",
        action="append",
        type=parse_tokens,
        metavar="TOKENS",
        help="CPU (first lower) tier capacity, repeatable: 300k, 1M ... (default 1M; "
        "with --sweep: 100k ... 30M)",
    )
    parser.add_argument(
        "--gpu-capacity",
        type=parse_tokens,
        default=0,
        metavar="TOKENS",
        help="GPU prefix cache (LRU) in front of the lower tiers (default 0: none)",
    )
    parser.add_argument(
        "--disk-capacity",
        "--disk",
        type=parse_tokens,
        default=0,
        metavar="TOKENS",
        help="a DISK tier behind the CPU tier, same policy (default 0: none); without "
        "--cascade it is fed independently (every block the CPU lacks is offered to both)",
    )
    parser.add_argument(
        "--cascade",
        choices=[m.value for m in CascadeMode],
        help="CPU -> DISK cascade (needs --disk-capacity; online policies only): stores go "
        "to the CPU tier, a lookup takes each block from CPU, else DISK. write_through: "
        "every block stored in CPU is copied to DISK at once (inclusive, capacity = max; "
        "restart-safe; one disk write per store). write_back: only blocks the CPU evicts "
        "move to DISK (exclusive, capacity = CPU + DISK; fewer disk writes; a crash loses "
        "the CPU-only blocks)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per trace hash block (default {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="capacity sweep: adds lru and belady (not with --cascade), writes sweep.csv and "
        "sweep.png to --out",
    )
    parser.add_argument("--out", default="replay_out", help="folder for the sweep CSV and plot")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write every result as JSON (adds lru and belady, the reference lines; "
        "belady not with --cascade)",
    )
    parser.add_argument(
        "--release-order",
        choices=[o.value for o in ReleaseOrder],
        default=ReleaseOrder.TAIL_FIRST.value,
        help="when/how a request's tier blocks are freed: tail_first (all at the end, last "
        "position first: SPEC §4, default), scheduler (what OffloadScheduler does today: "
        "loads freed in position order before the stores allocate, then the stores) or "
        "scheduler_tail_first (the same, each freed last position first: the proposed fix)",
    )
    defaults = CostModel()
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=defaults.prefill_tokens_per_s,
        help=f"TTFT model: prefill speed (default {defaults.prefill_tokens_per_s:g})",
    )
    parser.add_argument(
        "--bytes-per-token",
        type=int,
        default=defaults.bytes_per_token,
        help=f"KV bytes per token (default {defaults.bytes_per_token}: Llama-3-8B bf16)",
    )
    parser.add_argument(
        "--cpu-link-gbps",
        type=float,
        default=DEFAULT_LINK_GBPS["CPU"],
        help=f"CPU -> GPU load link in GB/s (default {DEFAULT_LINK_GBPS['CPU']:g})",
    )
    parser.add_argument(
        "--disk-link-gbps",
        type=float,
        default=DEFAULT_LINK_GBPS["DISK"],
        help=f"DISK -> GPU load link in GB/s (default {DEFAULT_LINK_GBPS['DISK']:g})",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def add_parser(subparsers: Any) -> None:
    """Register `kvtier replay`."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a request trace through the tiers: hit ratio per policy and capacity",
        description=__doc__.splitlines()[0] + " " + _DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)


_DESCRIPTION = """
Each request looks up its prompt's block hashes (prefix hits only) in the GPU tier, then
in each lower tier from where the previous one stopped; then its blocks are offered for
storing (eager, admission policy first) into every lower tier, whose BlockPool evicts
per the eviction policy. Reports per-tier token hit ratios, blocks stored and evicted,
bytes that would move and an estimated TTFT. With --cascade the CPU and DISK tiers form
a cascade instead (stores into CPU; DISK fed write-through or write-back). See
docs/policies.md.

examples:
  kvtier replay trace.jsonl --policy lru --policy lfuda --capacity 1M --capacity 3M
  kvtier replay trace.jsonl --sweep --policy arc --policy s3fifo --out out/ --json r.json
  kvtier replay trace.jsonl --cpu 1M --disk 4M --cascade write_back
  python -m kvtier.replay.generate chat.jsonl     # the multi-turn chat workload
"""


def build_config(args: argparse.Namespace) -> ReplayConfig:
    """Return the base replay configuration described by the parsed arguments."""
    if args.cascade and not args.disk_capacity:
        raise ReplayError(f"--cascade {args.cascade} needs a DISK tier: add --disk-capacity")
    tiers = [TierConfig("CPU", (args.capacity or [1_000_000])[0], args.cpu_link_gbps)]
    if args.disk_capacity:
        tiers.append(TierConfig("DISK", args.disk_capacity, args.disk_link_gbps))
    return ReplayConfig(
        tiers=tuple(tiers),
        gpu_capacity_tokens=args.gpu_capacity,
        block_size=args.block_size,
        release_order=ReleaseOrder(args.release_order),
        cost=CostModel(args.prefill_tokens_per_s, args.bytes_per_token),
        cascade=CascadeMode(args.cascade) if args.cascade else None,
    )


def format_table(points: Sequence[SweepPoint]) -> str:
    """Return the results as an aligned text table."""
    table = hit_ratio_table(points)
    header = (
        f"{'policy':<14}{'capacity':>9}{'hit':>8}{'xBelady':>9}{'xLRU':>7}{'stored':>9}"
        f"{'evicted':>9}{'GB stored':>10}{'GB loaded':>10}{'TTFT s':>8}"
    )
    lines = [header, "-" * len(header)]
    for point in points:
        row = point_row(point, table)
        xb = "-" if row["x_belady"] is None else f"{row['x_belady']:.2f}"
        xl = "-" if row["x_lru"] is None else f"{row['x_lru']:.2f}"
        hits = " ".join(f"{t.name}:{t.token_hit_ratio:.3f}" for t in point.result.tiers)
        gpu = point.result.gpu
        if gpu is not None:
            hits = f"GPU:{gpu.token_hit_ratio:.3f} " + hits
        if point.result.cascade is not None:
            cpu = point.result.tiers[0]
            hits += f" to-disk:{cpu.num_demoted_blocks} promoted:{cpu.num_promoted_blocks}"
        lines.append(
            f"{point.policy:<14}{format_tokens(point.capacity_tokens):>9}"
            f"{point.result.token_hit_ratio:>8.3f}{xb:>9}{xl:>7}{row['blocks_stored']:>9}"
            f"{row['blocks_evicted']:>9}{row['bytes_stored'] / 1e9:>10.1f}"
            f"{row['bytes_loaded'] / 1e9:>10.1f}{row['mean_ttft_s']:>8.3f}  {hits}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the replay described by parsed arguments; return the exit status."""
    try:
        records = read_trace(args.trace, args.block_size)
        base = build_config(args)
        policies = list(dict.fromkeys(args.policy or [LRU]))
        capacities = list(dict.fromkeys(args.capacity or [1_000_000]))
        if args.sweep and not args.capacity:
            capacities = list(DEFAULT_SWEEP_TOKENS)
        if args.sweep or args.json:  # the reference lines (a cascade cannot run Belady)
            references = [LRU] if base.cascade else [LRU, BELADY]
            policies = [p for p in policies if p not in (LRU, BELADY)] + references
        for capacity in capacities:  # validate every configuration before the long run
            first = TierConfig("CPU", capacity, args.cpu_link_gbps)
            dataclasses.replace(base, tiers=(first, *base.tiers[1:]))
        for policy in policies:
            dataclasses.replace(base, policy=policy)
    except (OSError, TraceError, ReplayError, ValueError) as exc:
        print(f"kvtier replay: error: {exc}", file=sys.stderr)
        return 2
    summary = summarize(records, args.block_size)
    print(
        f"{args.trace}: {summary.num_requests} requests, {summary.num_block_refs} block refs, "
        f"{summary.num_distinct_blocks} distinct blocks, infinite-cache token hit ratio "
        f"{summary.infinite_token_hit_ratio:.3f}"
    )
    progress = None
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(policies) * len(capacities) * len(records), unit="req", leave=False)
        progress = bar.update
    try:
        points = run_sweep(records, base, policies, capacities, progress)
    except ReplayError as exc:
        print(f"kvtier replay: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    print(format_table(points))
    print(
        f"hit: lower-tier token hit ratio; TTFT s: mean estimated TTFT "
        f"(without any cache: {points[0].result.mean_ttft_no_cache_s:.3f} s)"
    )
    if args.sweep:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(out / "sweep.csv", points)
        plot_sweep(
            out / "sweep.png", points, Path(args.trace).name, summary.infinite_token_hit_ratio
        )
        print(f"wrote {out / 'sweep.csv'} and {out / 'sweep.png'}")
    if args.json:
        write_json(args.json, points, args.trace, summary)
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kvtier replay` as a standalone command; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="kvtier replay",
        description=__doc__.splitlines()[0] + " " + _DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    args = parser.parse_args(argv)
    status: int = args.run(args)
    return status
