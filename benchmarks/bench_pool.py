"""Pool scaling: time per BlockPool operation and bytes per cached block, 10k to 10M blocks.

Every size is built in one process and timed side by side: reps rotate over the sizes, and
each size's time is divided by the smallest size's time *of the same rep* (paired ratios),
so machine load that drifts during the run hits all sizes alike.

Each pool has every usable block cached and free, in a random eviction order: blocks are
allocated, each given a realistic 36-byte key (32 random bytes standing in for a sha256
digest + a 4-byte group id, `make_key`), then freed in a random permutation, so eviction
visits block ids, key objects and queue neighbours in random memory order, as a
long-running tier does.

Memory: the growth of the resident set (RSS, /proc/self/statm) from just before a pool is
created to just after it is full, divided by its number of cached blocks. It includes
everything the pool owns: the key bytes objects, the index dict, the int objects of block
ids, the per-block arrays and list, and allocator overhead. A `sys.getsizeof` breakdown of
the same structures (requested sizes, no allocator overhead) is printed alongside. Then
blocks are evicted and re-cached until the index dict resizes: under delete/insert churn
a dict regrows to 3-6 slots per entry (twice its size after pure inserts) and never
shrinks, so "churn, max" = built RSS + the index's growth is what a long-running tier
reaches just before each further resize. Timing runs on the churned pools.

Time: rounds of steady-state operations on random blocks, each kind timed as a batch —
touch(b random free blocks), free(them), cached_block(key) for b random keys, allocate(b)
(pops the head: evicts b cached blocks, dropping their keys), insert_key(new key) on each
of them, then an untimed free that makes them cached again. A rep is `--ops` operations of
each kind (in rounds of at most a quarter of the pool); a quarter-rep warm-up, then the median
and min-max of `--reps` reps. Random access is deliberate: at 10M blocks it defeats the
CPU caches, as a big tier's traffic does.

Progress bars (stderr, a terminal only) count the blocks built and churned and the reps
timed; each moves between timed sections (build chunks, reps), outside the timers.

Run: `python benchmarks/bench_pool.py [--sizes 10000,1000000,10000000] [--json PATH]
[--clock cpu]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench_common import (
    machine_info,
    new_parser,
    nonnegative_int,
    output_file,
    positive_int,
    positive_int_list,
)
from kvtier.core.block_pool import BlockPool
from pool_build import NUM_TOKENS, KeyMaker, build_size
from progress_bar import progress_bar

DEFAULT_SIZES = (10_000, 1_000_000, 10_000_000)
OPS = ("allocate", "touch", "free", "insert_key", "cached_block")
# The same probes through the pool's own dict without the method call: the limit that
# CPython's dict sets on cached_block at each size. Printed, not part of the target.
BASELINE = "bare_dict_get"
TARGET_RATIO = 1.5
TARGET_BYTES = 200
CLOCKS: dict[str, Callable[[], int]] = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def transparent_hugepages() -> str | None:
    """Return the kernel's THP mode (huge pages cut TLB misses on big random-access pools)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0] if "[" in text else text.strip()


def time_rep(
    pool: BlockPool, num_ops: int, rng: random.Random, keys: KeyMaker, clock: Callable[[], int]
) -> dict[str, float]:
    """Run `num_ops` operations of each kind on random blocks; return ns per operation."""
    batch = max(1, min(num_ops, pool.num_usable_blocks // 4))
    totals = dict.fromkeys((*OPS, BASELINE), 0)
    bare_get = pool._index.get  # private on purpose: the baseline
    done = 0
    while done < num_ops:
        size = min(batch, num_ops - done)
        touched = rng.sample(range(1, pool.num_blocks), size)
        probes = [pool.key(b) for b in rng.sample(range(1, pool.num_blocks), size)]
        bare_probes = [pool.key(b) for b in rng.sample(range(1, pool.num_blocks), size)]
        new_keys = keys.take(size)

        t0 = clock()
        pool.touch(touched)
        t1 = clock()
        pool.free(touched)
        t2 = clock()
        for key in probes:
            pool.cached_block(key)
        t3 = clock()
        for key in bare_probes:
            bare_get(key)
        t3b = clock()
        taken = pool.allocate(size)
        t4 = clock()
        for key, block_id in zip(new_keys, taken, strict=True):
            pool.insert_key(key, block_id, NUM_TOKENS)
        t5 = clock()
        pool.free(taken)

        totals["touch"] += t1 - t0
        totals["free"] += t2 - t1
        totals["cached_block"] += t3 - t2
        totals[BASELINE] += t3b - t3
        totals["allocate"] += t4 - t3b
        totals["insert_key"] += t5 - t4
        done += size
    assert pool.num_free() == pool.num_usable_blocks
    return {op: total / num_ops for op, total in totals.items()}


def run(sizes: list[int], args: argparse.Namespace) -> list[dict]:
    """Build every size, then time reps rotating over the sizes; return every number."""
    np_rng = np.random.default_rng(args.seed)
    rng = random.Random(args.seed)
    keys = KeyMaker(args.seed)
    pools, results = [], []
    for num_blocks in sizes:
        pool, result = build_size(num_blocks, np_rng, keys, label(num_blocks))
        pools.append(pool)
        results.append(result)
        print(f"  built {label(num_blocks)} blocks in {result['build_s']:.1f} s", flush=True)
    clock = CLOCKS[args.clock]
    reps: list[dict[str, list[float]]] = [{op: [] for op in (*OPS, BASELINE)} for _ in sizes]
    with progress_bar((args.reps + 1) * len(sizes), unit="rep", desc="time") as bar:
        for rep in range(-1, args.reps):  # rep -1 is a shorter warm-up
            num_ops = args.ops if rep >= 0 else max(1, args.ops // 4)
            for i in [(rep + k) % len(sizes) for k in range(len(sizes))]:
                times = time_rep(pools[i], num_ops, rng, keys, clock)
                bar.update(1)  # between reps: time_rep's clocks are inside it
                for op in (*OPS, BASELINE):
                    if rep >= 0:
                        reps[i][op].append(times[op])
    for result, per_op in zip(results, reps, strict=True):
        result["ns_per_op"] = {}
        for op, values in per_op.items():
            paired = [v / b for v, b in zip(values, reps[0][op], strict=True)]
            result["ns_per_op"][op] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "reps": values,
                "ratio_to_smallest": statistics.median(paired),
                "ratio_to_smallest_reps": paired,
            }
    return results


def summarize(results: list[dict]) -> tuple[dict, str]:
    """Return the largest size's ratios to the smallest and the one summary line."""
    base, top = results[0], results[-1]
    ratios = {op: top["ns_per_op"][op]["ratio_to_smallest"] for op in OPS}
    worst = max(ratios, key=ratios.__getitem__)
    baseline = top["ns_per_op"][BASELINE]["ratio_to_smallest"]
    top_bytes = top["rss_bytes_per_cached_block"]
    top_steady = top["steady_rss_bytes_per_cached_block"]
    summary = {
        "base_num_blocks": base["num_blocks"],
        "top_num_blocks": top["num_blocks"],
        "per_op_ratio": ratios,
        "per_op_ratio_max": ratios[worst],
        "per_op_ratio_max_op": worst,
        "bare_dict_get_ratio": baseline,
        "bytes_per_cached_block_at_top": top_bytes,
        "steady_bytes_per_cached_block_at_top": top_steady,
        "target_ratio": TARGET_RATIO,
        "target_bytes": TARGET_BYTES,
    }
    line = (
        f"bench_pool: per-op ratio {label(top['num_blocks'])}/{label(base['num_blocks'])}"
        f" max {ratios[worst]:.2f} ({worst}; target <= {TARGET_RATIO};"
        f" bare dict.get {baseline:.2f}),"
        f" bytes/cached block at {label(top['num_blocks'])} {fmt(top_bytes, '.0f')} built,"
        f" up to {fmt(top_steady, '.0f')} under churn (RSS; target <= {TARGET_BYTES})"
    )
    return summary, line


def label(num_blocks: int) -> str:
    """Return 10k / 1M style names for round sizes."""
    for unit, name in ((1_000_000, "M"), (1_000, "k")):
        if num_blocks >= unit and num_blocks % unit == 0:
            return f"{num_blocks // unit}{name}"
    return str(num_blocks)


def fmt(value: float | None, spec: str) -> str:
    """Format a number that may be missing."""
    return "n/a" if value is None else format(value, spec)


def print_table(results: list[dict]) -> None:
    """Print ns/op (median, min-max, paired ratio to the smallest size) and bytes per block."""
    width = 31
    print(f"{'':15}" + "".join(f"{label(r['num_blocks']):>{width}}" for r in results))
    for op in (*OPS, BASELINE):
        cells = []
        for r in results:
            t = r["ns_per_op"][op]
            span = f"({t['min']:.0f}-{t['max']:.0f})"
            cells.append(f"{t['median']:6.0f} ns {span:>11} x{t['ratio_to_smallest']:4.2f}")
        print(f"{op:15}" + "".join(f"{c:>{width}}" for c in cells))
    rows: list[tuple[str, Callable[[dict], float | None]]] = [
        ("B/block RSS", lambda r: r["rss_bytes_per_cached_block"]),
        ("  churn, max", lambda r: r["steady_rss_bytes_per_cached_block"]),
        ("B/block sizeof", lambda r: r["getsizeof_total_per_cached_block"]),
        ("  churn", lambda r: r["steady_getsizeof_total_per_cached_block"]),
    ]
    for name, get in rows:
        cells = []
        for r in results:
            value, ref = get(r), get(results[0])
            ratio = f"x{value / ref:4.2f}" if value is not None and ref else "    -"
            cells.append(f"{fmt(value, '6.1f')} B {ratio}")
        print(f"{name:15}" + "".join(f"{c:>{width}}" for c in cells))
    top = results[-1]
    for when in ("", "steady_"):
        breakdown = top[f"{when}getsizeof_bytes_per_cached_block"]
        parts = ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items())
        state = "under churn" if when else "built"
        print(f"getsizeof at {label(top['num_blocks'])} {state}, B/block: {parts}")
    builds = (f"{label(r['num_blocks'])} {r['build_s']:.1f} s" for r in results)
    churns = (f"{label(r['num_blocks'])} {r['num_churned_blocks']}" for r in results)
    print(
        f"build time: {', '.join(builds)}; blocks churned until the index regrew:"
        f" {', '.join(churns)}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--sizes",
        type=positive_int_list,
        default=list(DEFAULT_SIZES),
        help="pool sizes in blocks, a comma list",
    )
    parser.add_argument("--ops", type=positive_int, default=100_000, help="ops per kind per rep")
    parser.add_argument("--reps", type=positive_int, default=5, help="repetitions")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="random seed")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="timer")
    parser.add_argument("--json", type=output_file, help="write every number to this file")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    sizes = sorted(set(args.sizes))
    machine = {
        **machine_info(),
        "transparent_hugepages": transparent_hugepages(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    }
    print(
        f"bench_pool: {machine['cpus_usable']} cores, {machine['implementation']}"
        f" {machine['python']}, {machine['platform']}, load {machine['load_average']},"
        f" THP {machine['transparent_hugepages']}, GLIBC_TUNABLES {machine['glibc_tunables']};"
        f" {args.ops} ops/kind/rep, median (min-max) of {args.reps} reps, {args.clock} clock,"
        f" x = paired ratio to {label(sizes[0])}; memory = RSS delta"
    )
    t0 = time.perf_counter()
    results = run(sizes, args)
    print_table(results)
    summary, line = summarize(results)
    print(f"total {time.perf_counter() - t0:.0f} s")
    print(line)
    if args.json:
        payload = {
            "machine": machine,
            "ops_per_rep": args.ops,
            "reps": args.reps,
            "clock": args.clock,
            "results": results,
            "summary": summary,
            "summary_line": line,
        }
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
