"""Host transfer bandwidth: worker stores/loads vs one contiguous copy_ of the same bytes.

For each block size (bytes per block per region) and region count, one transfer moves
about `--total-mib` MiB. Patterns:

- `store`: scattered engine blocks → fresh, consecutive tier slots (a new tier);
- `load`: scattered tier slots → freshly allocated, consecutive engine blocks;
- `frag store` / `frag load`: scattered on both sides (a long-running, churned tier).

Each transfer is timed through the public worker API (submit + flush + poll) between two
copies of the baseline (a single `copy_` of one contiguous buffer into another, the same
bytes, same devices, same direction: engine → host for stores, host → engine for loads;
pinned host memory on a GPU): per direction `copy, store, copy, frag store, copy`, each
repetition. A transfer's ratio is the mean of the two copies beside it / its time (= GB/s
ratio), so the cores and memory bandwidth a shared machine gives the run, which drift from
second to second, are the same for both sides of each ratio; the table shows the median.
Target (BENCHMARKS.md): >= 0.7x at >= 64 KiB blocks on CPU, >= 0.9x of a pinned
contiguous copy on a GPU.

Baseline buffers (CPU): the copies take turns over as many buffer pairs as span the
worker's own memory (engine regions + host tier, 4 transfers' bytes: 2 pairs), so the
baseline's memory is as far from the CPU caches as the transfers'. With one pair, reused
by every copy, a machine whose last-level cache holds that pair (this 2-core VM reports a
480 MiB L3) times the baseline from cache while the transfers, which walk twice its bytes,
run from memory: a 64 MiB `copy_` took 3.1 ms back to back and 5.9 ms after touching 1 GiB
(2026-12-06). `--baseline-pairs 1` reproduces the single pair. On this VM the transfers
ran at 10-12 GB/s either way, the baseline at 17-20 GB/s from one pair and 12 from two:
the summary read 0.61x (min 0.54x) with one pair and 0.92-0.93x (min 0.84x) with two. On
a GPU the copy is a DMA (no CPU cache in the way) and one pair is used.

OpenMP: after each parallel op, torch's OpenMP threads spin for a while (libgomp's
default wait policy) before they sleep. A transfer timed right after the baseline `copy_`
then shares the cores with them: on 2 cores that halved its speed (summary 0.46x against
0.71x), while the `copy_` alone runs at the same 22-24 GB/s either way. So the benchmark
runs itself with OMP_WAIT_POLICY=PASSIVE (re-started with it when the environment has
another value); `--omp-wait-policy inherit` keeps the environment's.

    python benchmarks/bench_transfer.py [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from bench_common import add_copy_threads, new_parser, output_file, positive_int, write_json
from kvtier.offload.plan import Tier, TransferJob, TransferPlan
from kvtier.transfer import OffloadWorker, TensorLayout, WorkerConfig

PATTERNS = ("store", "load", "frag_store", "frag_load")


@dataclass(frozen=True)
class Row:
    """One configuration's results; times are medians in seconds, ratios baseline/op."""

    block_kib: int
    regions: int
    blocks: int
    mib: float
    copy_gbs: float  # from the median baseline copy, each timed copy counted once
    gbs: dict[str, float]
    ratio: dict[str, float]
    ratio_spread: dict[str, tuple[float, float]]


class Case:
    """Engine tensors, a registered worker and the baseline buffers of one configuration."""

    def __init__(
        self,
        block_bytes: int,
        regions: int,
        num: int,
        device: str,
        copy_threads: int | None,
        baseline_pairs: int | None = None,
    ) -> None:
        self.num = num
        self.device = device
        num_blocks = 2 * num + 1
        self.kv = [
            torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, device=device)
            for _ in range(regions)
        ]
        self.worker = OffloadWorker(WorkerConfig(cpu_num_slots=2 * num, copy_threads=copy_threads))
        self.worker.register(self.kv, TensorLayout.BLOCKS_FIRST)
        nbytes = num * block_bytes * regions
        worker_bytes = (num_blocks + 2 * num) * block_bytes * regions  # regions + host tier
        if baseline_pairs is None:
            baseline_pairs = 1 if device == "cuda" else max(1, round(worker_bytes / (2 * nbytes)))
        self.pairs = [
            (
                torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device),
                torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device == "cuda"),
            )
            for _ in range(baseline_pairs)
        ]
        self._turn = 0  # the pair the next baseline copy uses
        self.event_id = 0
        rng = np.random.default_rng(0)
        blocks = rng.permutation(np.arange(1, num_blocks))
        slots = rng.permutation(2 * num)
        self.ids = {
            "store": (blocks[:num], np.arange(num)),
            "load": (slots[:num], np.arange(num + 1, 2 * num + 1)),
            "frag_store": (blocks[num:], slots[num:]),
            "frag_load": (slots[:num], blocks[:num]),
        }

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def copy_down(self) -> None:
        """The store baseline: engine device → host, one contiguous copy."""
        src, dst = self._next_pair()
        dst.copy_(src, non_blocking=self.device == "cuda")
        self.sync()

    def copy_up(self) -> None:
        """The load baseline: host → engine device, one contiguous copy."""
        src, dst = self._next_pair()
        src.copy_(dst, non_blocking=self.device == "cuda")
        self.sync()

    def _next_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the baseline buffers whose turn it is (engine side, host side)."""
        pair = self.pairs[self._turn % len(self.pairs)]
        self._turn += 1
        return pair

    def transfer(self, pattern: str) -> None:
        src_ids, dst_ids = self.ids[pattern]
        src, dst = (Tier.GPU, Tier.CPU) if "store" in pattern else (Tier.CPU, Tier.GPU)
        self.event_id += 1
        job = TransferJob(self.event_id, src, dst, tuple(src_ids.tolist()), tuple(dst_ids.tolist()))
        self.worker.submit(TransferPlan(self.event_id, jobs=(job,)))
        self.worker.flush()
        report = self.worker.poll()
        assert dict(report.done) == {self.event_id: 1}, report


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Timings:
    """What `measure` timed, in seconds."""

    base: dict[str, list[float]]  # by pattern: the mean of the copies beside each transfer
    times: dict[str, list[float]]  # by pattern, pairwise with `base` in rep order
    copies: list[float]  # every baseline copy once (the middle one of a group is in two means)


def measure(case: Case, reps: int) -> Timings:
    """Warm up, then time every pattern `reps` times, each between two baseline copies."""
    case.copy_down()
    case.copy_up()
    for pattern in PATTERNS:
        case.transfer(pattern)
    base: dict[str, list[float]] = {p: [] for p in PATTERNS}
    times: dict[str, list[float]] = {p: [] for p in PATTERNS}
    copies: list[float] = []
    by_direction = (
        (case.copy_down, ("store", "frag_store")),
        (case.copy_up, ("load", "frag_load")),
    )
    for _ in range(reps):
        for copy, patterns in by_direction:
            before = timed(copy)
            copies.append(before)
            for pattern in patterns:
                times[pattern].append(timed(lambda p=pattern: case.transfer(p)))  # type: ignore[misc]
                after = timed(copy)
                copies.append(after)
                base[pattern].append((before + after) / 2)
                before = after
    return Timings(base, times, copies)


def run_config(block_kib: int, regions: int, args: argparse.Namespace) -> Row:
    block_bytes = block_kib << 10
    num = max(4, (args.total_mib << 20) // (block_bytes * regions))
    case = Case(block_bytes, regions, num, args.device, args.copy_threads, args.baseline_pairs)
    try:
        timings = measure(case, args.reps)
    finally:
        case.worker.shutdown()
    base, times = timings.base, timings.times
    nbytes = num * block_bytes * regions
    ratios = {p: [b / t for b, t in zip(base[p], times[p], strict=True)] for p in PATTERNS}
    return Row(
        block_kib=block_kib,
        regions=regions,
        blocks=num,
        mib=nbytes / 2**20,
        copy_gbs=nbytes / statistics.median(timings.copies) / 1e9,
        gbs={p: nbytes / statistics.median(times[p]) / 1e9 for p in PATTERNS},
        ratio={p: statistics.median(ratios[p]) for p in PATTERNS},
        ratio_spread={p: (min(ratios[p]), max(ratios[p])) for p in PATTERNS},
    )


def summarize(rows: list[Row], device: str, seconds: float) -> dict[str, float]:
    """Print the summary line (min and median over configurations) and return its numbers."""
    big = [r for r in rows if r.block_kib >= 64]
    plain = [r.ratio[p] for r in big for p in ("store", "load")]
    frag = [r.ratio[p] for r in big for p in ("frag_store", "frag_load")]
    summary = {
        "min_ratio_ge_64k": min(plain),
        "median_ratio_ge_64k": statistics.median(plain),
        "min_frag_ratio_ge_64k": min(frag),
        "median_frag_ratio_ge_64k": statistics.median(frag),
        "target": 0.7 if device == "cpu" else 0.9,
        "seconds": seconds,
    }
    print(
        f"bench_transfer: store/load at >= 64 KiB blocks {summary['median_ratio_ge_64k']:.2f}x of "
        f"contiguous copy_ (median over configs; min {summary['min_ratio_ge_64k']:.2f}x; "
        f"target >= {summary['target']}x); fragmented {summary['median_frag_ratio_ge_64k']:.2f}x "
        f"(min {summary['min_frag_ratio_ge_64k']:.2f}x); {seconds:.0f} s"
    )
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the 'GPU' tensors live"
    )
    parser.add_argument("--total-mib", type=positive_int, default=64, help="MiB moved per transfer")
    parser.add_argument("--reps", type=positive_int, default=7, help="interleaved repetitions")
    parser.add_argument(
        "--block-kib",
        type=positive_int,
        nargs="+",
        default=[4, 16, 64, 256, 1024, 2048],
        help="block sizes in KiB",
    )
    parser.add_argument(
        "--regions",
        type=positive_int,
        nargs="+",
        default=[1, 32],
        help="regions (layers x K/V) per block",
    )
    add_copy_threads(parser)
    parser.add_argument(
        "--baseline-pairs",
        type=positive_int,
        help="buffer pairs the baseline copies take turns over (default: on a CPU as many "
        "as span the worker's engine regions and host tier, 2; on a GPU 1)",
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=["passive", "inherit"],
        default="passive",
        help="passive: run with OMP_WAIT_POLICY=PASSIVE, so that the baseline copy's OpenMP "
        "threads do not spin on the cores the transfer timed next needs; inherit: as the "
        "environment says (default: passive)",
    )
    parser.add_argument("--json", type=output_file, help="write every number to this file")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the options; the summary (and its target) is over blocks of >= 64 KiB, so
    at least one --block-kib must be that big."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if max(args.block_kib) < 64:
        parser.error(
            f"argument --block-kib: the summary and its target are over blocks of >= 64 KiB; "
            f"got only {' '.join(map(str, args.block_kib))}"
        )
    return args


def main() -> None:
    args = parse_args()
    if args.omp_wait_policy == "passive" and os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":
        # The OpenMP runtime read the policy when torch loaded it: start again with it set.
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    started = time.perf_counter()
    machine = (
        f"{os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, device {args.device}, "
        f"copy_threads={args.copy_threads}, baseline_pairs={args.baseline_pairs or 'auto'}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
    )
    print(
        f"bench_transfer: {machine}; {args.total_mib} MiB per transfer, median of "
        f"{args.reps} reps, ratio = contiguous copy_ time (mean of the copies timed just "
        "before and after) / transfer time"
    )
    header = f"{'block':>7} {'reg':>3} {'blocks':>6} {'copy GB/s':>9} " + " ".join(
        f"{p:>17}" for p in PATTERNS
    )
    print(header)
    rows = []
    for regions in args.regions:
        for block_kib in args.block_kib:
            row = run_config(block_kib, regions, args)
            rows.append(row)
            cells = " ".join(f"{row.gbs[p]:6.2f} ({row.ratio[p]:4.2f}x)   " for p in PATTERNS)
            print(f"{block_kib:>5}Ki {regions:>3} {row.blocks:>6} {row.copy_gbs:>9.2f} {cells}")
    summary = summarize(rows, args.device, time.perf_counter() - started)
    if args.json:
        write_json(args.json, machine, args, summary, rows)


if __name__ == "__main__":
    main()
