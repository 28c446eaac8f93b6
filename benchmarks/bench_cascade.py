"""CPU-only vs DISK-only vs a CPU → DISK cascade at equal total bytes (trace replay).

Two workloads, replayed whole: the Mooncake trace (/work/shared/traces/
mooncake_synthetic_trace.jsonl, 3,993 requests, 512-token blocks) and the multi-turn chat
workload of `kvtier.replay.generate` (default parameters, seed 0, ~4,500 requests). For
each total capacity (1 M and 3 M tokens) and policy (`lru`, and `lfuda`: the best online
policy of docs/policies.md) four setups share the same bytes:

    cpu-only        all of it in the CPU tier (25 GB/s link)
    disk-only       all of it on DISK (5 GB/s link)
    write-through   CPU 1/4 + DISK 3/4, inclusive cascade (every CPU store also on DISK)
    write-back      CPU 1/4 + DISK 3/4, exclusive cascade (CPU evictions move to DISK)

No GPU tier, tail-first release, the replay's default cost model (Llama-3-8B bf16:
128 KiB of KV per token, 10 k prefill tokens/s). Printed per workload: token hit ratio of
each tier and overall, mean estimated TTFT and its ratio to cpu-only (the baseline in
the same run: the same bytes as host memory), and the GB written to DISK. The summary
line gives Mooncake with `lru`. `--json PATH` writes every row. The four (workload,
policy) runs share --jobs processes; a progress bar on stderr (on a terminal) counts the
requests they replayed (its total grows as each run starts).

Run: `python benchmarks/bench_cascade.py [--json PATH] [--jobs N] [--requests N]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_common import existing_file, new_parser, output_file, positive_int, write_json
from kvtier.replay.config import CascadeMode, ReplayConfig, TierConfig
from kvtier.replay.generate import ChatWorkloadConfig, generate_chat_trace
from kvtier.replay.tier_replay import TierReplay, trace_keys
from kvtier.replay.trace import DEFAULT_BLOCK_SIZE, TraceRecord, read_trace
from pool_progress import Progress, run_with_progress

MOONCAKE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
TOTALS = (1_000_000, 3_000_000)
POLICIES = ("lru", "lfuda")
SETUPS = ("cpu-only", "disk-only", "write-through", "write-back")
CPU_SHARE = 4  # the cascade's CPU tier holds 1/4 of the total


@dataclass(frozen=True)
class Row:
    """One replay: a workload, a total capacity, a policy and a setup."""

    workload: str
    total_tokens: int
    policy: str
    setup: str
    cpu_tokens: int
    disk_tokens: int
    cpu_hit: float
    disk_hit: float
    hit: float
    mean_ttft_s: float
    ttft_vs_cpu_only: float
    disk_gb_written: float
    promoted_blocks: int
    runtime_s: float


def fmt_tokens(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def setup_config(setup: str, total: int, policy: str) -> ReplayConfig:
    """Return the replay configuration of one setup at `total` tokens."""
    if setup == "cpu-only":
        tiers: tuple[TierConfig, ...] = (TierConfig.named("CPU", total),)
        cascade = None
    elif setup == "disk-only":
        tiers, cascade = (TierConfig.named("DISK", total),), None
    else:
        cpu = total // CPU_SHARE
        tiers = (TierConfig.named("CPU", cpu), TierConfig.named("DISK", total - cpu))
        cascade = CascadeMode(setup.replace("-", "_"))
    return ReplayConfig(tiers=tiers, policy=policy, cascade=cascade)


def load_workload(name: str, trace: Path, requests: int | None) -> list[TraceRecord]:
    """Return the records of `name` (the first `requests` if given)."""
    if name == "mooncake":
        records = read_trace(trace)
    else:
        records = generate_chat_trace(ChatWorkloadConfig())
    return records[:requests] if requests else records


def run_workload(
    name: str, trace: Path, policy: str, requests: int | None, progress: Progress
) -> list[Row]:
    """Replay every setup and total of one workload and policy (runs in a worker)."""
    records = load_workload(name, trace, requests)
    progress.add_total(len(TOTALS) * len(SETUPS) * len(records))
    keys = trace_keys(records, DEFAULT_BLOCK_SIZE)  # setup_config's block size
    rows = []
    for total in TOTALS:
        baseline = 0.0
        for setup in SETUPS:
            config = setup_config(setup, total, policy)
            result = TierReplay(records, config, keys).run(progress.advance)
            by_name = {t.name: t for t in result.tiers}
            cpu, disk = by_name.get("CPU"), by_name.get("DISK")
            if setup == "cpu-only":
                baseline = result.mean_ttft_s
            rows.append(
                Row(
                    workload=name,
                    total_tokens=total,
                    policy=policy,
                    setup=setup,
                    cpu_tokens=cpu.capacity_tokens if cpu else 0,
                    disk_tokens=disk.capacity_tokens if disk else 0,
                    cpu_hit=cpu.token_hit_ratio if cpu else 0.0,
                    disk_hit=disk.token_hit_ratio if disk else 0.0,
                    hit=result.token_hit_ratio,
                    mean_ttft_s=result.mean_ttft_s,
                    ttft_vs_cpu_only=result.mean_ttft_s / baseline,
                    disk_gb_written=disk.bytes_stored / 1e9 if disk else 0.0,
                    promoted_blocks=cpu.num_promoted_blocks if cpu else 0,
                    runtime_s=result.runtime_s,
                )
            )
    return rows


def print_table(name: str, num_requests: int, rows: Sequence[Row]) -> None:
    """Print one workload's rows."""
    print(f"\n{name} ({num_requests} requests): token hit ratio and mean estimated TTFT")
    header = (
        f"{'total':>6} {'policy':<7}{'setup':<14}{'CPU':>8}{'DISK':>8}{'CPU hit':>9}"
        f"{'DISK hit':>9}{'hit':>7}{'TTFT s':>8}{'xCPU-only':>10}{'disk GB w':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{fmt_tokens(r.total_tokens):>6} {r.policy:<7}{r.setup:<14}"
            f"{fmt_tokens(r.cpu_tokens) if r.cpu_tokens else '-':>8}"
            f"{fmt_tokens(r.disk_tokens) if r.disk_tokens else '-':>8}"
            f"{r.cpu_hit:>9.3f}{r.disk_hit:>9.3f}{r.hit:>7.3f}{r.mean_ttft_s:>8.3f}"
            f"{r.ttft_vs_cpu_only:>10.3f}{r.disk_gb_written:>10.0f}"
        )


def summary_line(rows: Sequence[Row]) -> str:
    """Mooncake, lru: hit ratio and TTFT per setup at each total; write-back vs cpu-only."""
    parts = []
    for total in TOTALS:
        cells = [
            f"{r.setup} {r.hit:.3f}/{r.mean_ttft_s:.3f}s"
            for r in rows
            if r.workload == "mooncake" and r.policy == "lru" and r.total_tokens == total
        ]
        parts.append(f"{fmt_tokens(total)}: " + ", ".join(cells))
    wb = {
        r.total_tokens: r.ttft_vs_cpu_only
        for r in rows
        if r.workload == "mooncake" and r.policy == "lru" and r.setup == "write-back"
    }
    ratios = ", ".join(f"{wb[t]:.3f} at {fmt_tokens(t)}" for t in TOTALS)
    return (
        "bench_cascade: mooncake lru hit/TTFT at equal bytes, "
        + "; ".join(parts)
        + f"; write-back TTFT vs cpu-only {ratios}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument("--trace", type=existing_file, default=MOONCAKE, help="the Mooncake trace")
    parser.add_argument("--json", type=output_file, help="write every row as JSON")
    parser.add_argument("--jobs", type=positive_int, default=2, help="worker processes")
    parser.add_argument(
        "--requests",
        type=positive_int,
        help="replay only each workload's first N requests (default: all)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    scope = f"first {args.requests} requests" if args.requests else "whole workloads"
    print(
        f"bench_cascade: {machine}; totals {', '.join(map(fmt_tokens, TOTALS))}; "
        f"cascade CPU = 1/{CPU_SHARE} of the total; policies {', '.join(POLICIES)}; {scope}"
    )
    started = time.perf_counter()
    names = ("mooncake", "chat")
    tasks = [(n, p) for n in names for p in POLICIES]
    calls = [(run_workload, (n, args.trace, p, args.requests)) for n, p in tasks]
    results = run_with_progress(args.jobs, calls, unit="req")
    rows = [row for result in results for row in result]
    for name in names:
        mine = sorted(
            (r for r in rows if r.workload == name),
            key=lambda r: (r.total_tokens, POLICIES.index(r.policy), SETUPS.index(r.setup)),
        )
        count = len(load_workload(name, args.trace, args.requests))
        print_table(name, count, mine)
    summary = summary_line(rows)
    total = time.perf_counter() - started
    print(
        f"\nhit: lower tiers together; xCPU-only: TTFT / the cpu-only TTFT at the same total; "
        f"disk GB w: bytes written to DISK; total runtime {total:.0f} s"
    )
    print(summary)
    if args.json:
        write_json(args.json, machine, args, {"summary": summary, "runtime_s": total}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
