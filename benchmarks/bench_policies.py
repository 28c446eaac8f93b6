"""Tier policies' cost: µs per operation and bytes per cached block, against LRU, two capacities.

Every registered eviction policy (`lru`, `arc`, `s3fifo`, `lfuda`, `duel`) and every
admission policy on top of `lru` (`lru+door`) runs the same request stream through a
replay tier (`kvtier.replay.tier_store`: the real `BlockPool` with the policy's free
queue and admission, as `kvtier replay` and the offload scheduler build them), at two
capacities 10x apart. The stream and how a request is served (lookup + touch of the
hit prefix; offers, admission, allocation with eviction, `insert_key` and free of the
missing blocks; tail-first release) are in benchmarks/policy_workload.py.

Memory: each tier is filled (2 x capacity blocks stored, so every block is cached and
the policy's ghosts, sketches and shadows are at their steady size), then what it owns
is summed (`sys.getsizeof` of every object reachable from it: the pool, the policy and
admission state and the key objects they keep alive, the pool's and the ghosts'; see
`policy_workload.owned_bytes`) and divided by the capacity in blocks. Dicts and sketches
grow by powers of two, so bytes per block move with the capacity (LRU: 188 B at 20k,
227 B at 200k); a fixed part (`duel`'s shadow caches) weighs less in a larger tier.

Time: reps rotate over every (policy, capacity) tier, a warm-up rep first; each rep
serves `--requests` requests per tier, timed per request (hit phase, store phase); the
cost of a clock read, measured at the start and printed (~0.4 µs with the CPU clock on
these VMs), is subtracted once per timed interval (3 per request). Ratios are
paired: a policy's time divided by LRU's at the same capacity in the same rep (x lru),
or by its own time at the small capacity in the same rep (O(1): about 1 when the cost
per operation does not grow with the tier); the median of the reps, with min-max of the
times. A progress bar (stderr, a terminal only) counts the blocks stored while filling
and the tiers timed.

Run: `python benchmarks/bench_policies.py [--quick] [--json PATH] [--policy NAME ...]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

from bench_common import machine_info, new_parser, nonnegative_int, output_file, positive_int
from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES, PolicySpec
from policy_workload import PolicyTier, owned_bytes
from progress_bar import progress_bar

BASELINE = "lru"
SCALE = 10  # the large capacity is SCALE x the small one
DEFAULT_POLICIES = [*EVICTION_POLICIES, *(f"lru+{a}" for a in ADMISSION_POLICIES if a != "all")]
DEFAULTS = {"capacity": 20_000, "requests": 1_000, "reps": 15}
QUICK = {"capacity": 2_000, "requests": 200, "reps": 3}
FILL_CHUNK = 64  # requests between progress updates while filling
TIMES = ("us_per_ref", "us_per_hit", "us_per_store", "us_per_offer")
CLOCKS: dict[str, Callable[[], int]] = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def build_tiers(args: argparse.Namespace, capacities: list[int]) -> list[PolicyTier]:
    """Build and fill every (capacity, policy) tier and measure what it owns."""
    tiers = []
    total = sum(2 * c for c in capacities) * len(args.policy)
    with progress_bar(total, unit="block", desc="fill") as bar:
        for capacity in capacities:
            for policy in args.policy:
                item = PolicyTier.build(
                    policy, capacity, args.blocks_per_request, args.reuse, args.seed
                )
                served = item.fill(2 * capacity, FILL_CHUNK, bar.update)
                item.tier.pool.check_invariants()
                assert len(item.tier.pool.index) == capacity, "a filled tier has a free slot"
                owned = owned_bytes(item.tier)
                item.memory = {"bytes": owned, "bytes_per_block": owned / capacity}
                item.memory["fill_requests"] = served
                tiers.append(item)
    return tiers


def time_tiers(
    args: argparse.Namespace, tiers: list[PolicyTier], read_ns: float
) -> list[list[dict]]:
    """Time `args.reps` reps (after a warm-up rep) rotating over the tiers; return each
    tier's per-rep numbers (`Counts.per_op`), less `read_ns` per clock interval."""
    clock = CLOCKS[args.clock]
    reps: list[list[dict]] = [[] for _ in tiers]
    with progress_bar((args.reps + 1) * len(tiers), unit="tier", desc="time") as bar:
        for rep in range(-1, args.reps):
            num_requests = args.requests if rep >= 0 else max(1, args.requests // 4)
            for i in [(rep + k) % len(tiers) for k in range(len(tiers))]:
                gc.collect()
                counts = tiers[i].serve(num_requests, clock, read_ns)
                bar.update(1)
                if rep >= 0:
                    reps[i].append(counts.per_op() | {"counts": vars(counts)})
    return reps


def clock_read_ns(clock: Callable[[], int], reads: int = 20_000) -> float:
    """Return the nanoseconds one read of `clock` takes: the fastest of 5 batches (a
    batch the OS preempted reads slow; subtracting its time drove timings below 0)."""
    batches = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(reads):
            clock()
        batches.append((time.perf_counter_ns() - t0) / reads)
    return min(batches)


def paired(values: list[float], bases: list[float]) -> float:
    """Return the median of the per-rep ratios."""
    return statistics.median(v / b for v, b in zip(values, bases, strict=True))


def collect(tiers: list[PolicyTier], reps: list[list[dict]], capacities: list[int]) -> list[dict]:
    """Return one row per tier: medians, paired ratios to LRU and to the small capacity."""
    by_key = {(t.policy, t.capacity_blocks): (t, r) for t, r in zip(tiers, reps, strict=True)}
    rows = []
    for (policy, capacity), (item, runs) in by_key.items():
        lru = by_key[(BASELINE, capacity)]
        small = by_key[(policy, capacities[0])][1]
        row: dict = {"policy": policy, "capacity_blocks": capacity} | item.memory
        row["extra_bytes_per_block_vs_lru"] = (
            item.memory["bytes_per_block"] - lru[0].memory["bytes_per_block"]
        )
        for name in (*TIMES, "evictions_per_store", "refused_per_offer", "hit_ratio"):
            values = [run[name] for run in runs]
            row[name] = {"median": statistics.median(values), "min": min(values)}
            row[name] |= {"max": max(values), "reps": values}
            if name in TIMES:
                row[name]["x_lru"] = paired(values, [run[name] for run in lru[1]])
                row[name]["x_small"] = paired(values, [run[name] for run in small])
        rows.append(row)
    return rows


def label(num_blocks: int) -> str:
    """Return 20k / 1M style names for round sizes."""
    for unit, name in ((1_000_000, "M"), (1_000, "k")):
        if num_blocks >= unit and num_blocks % unit == 0:
            return f"{num_blocks // unit}{name}"
    return str(num_blocks)


HEADER = (
    "policy", "blocks", "µs/ref", "(min-max)", "x lru", "O(1)", "µs/hit", "x lru", "µs/offer",
    "x lru", "µs/store", "evict/st", "refused", "hits", "B/block", "vs lru",
)  # fmt: skip


def print_table(rows: list[dict]) -> None:
    """Print each tier's row: times (median, x lru, O(1)), op mix, memory."""
    for line in table_lines(rows):
        print(line)


def table_lines(rows: list[dict]) -> list[str]:
    """Return the table's header and a line per row, each column as wide as its widest
    cell (at a fixed width, a slow rep's min-max ran into the median beside it)."""
    lines = [list(HEADER), *(row_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    return [_aligned(line, widths) for line in lines]


def _aligned(cells: list[str], widths: list[int]) -> str:
    """Join `cells` two spaces apart: the policy left-aligned, the numbers right-aligned."""
    padded = [cells[0].ljust(widths[0])]
    padded += [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
    return "  ".join(padded).rstrip()


def row_cells(r: dict) -> list[str]:
    """Return a row's cells in HEADER's order."""
    ref, hit, offer = r["us_per_ref"], r["us_per_hit"], r["us_per_offer"]
    times = [ref["x_lru"], ref["x_small"], hit["median"], hit["x_lru"], offer["median"]]
    times += [offer["x_lru"], r["us_per_store"]["median"]]
    mix = [r[k]["median"] for k in ("evictions_per_store", "refused_per_offer", "hit_ratio")]
    return [
        r["policy"],
        label(r["capacity_blocks"]),
        f"{ref['median']:.2f}",
        f"({ref['min']:.2f}-{ref['max']:.2f})",
        *(f"{value:.2f}" for value in (*times, *mix)),
        f"{r['bytes_per_block']:.0f}",
        f"{r['extra_bytes_per_block_vs_lru']:+.0f}",
    ]


def summarize(rows: list[dict], capacities: list[int]) -> tuple[dict, str]:
    """Return the summary numbers and the one summary line (at the large capacity)."""
    top = {r["policy"]: r for r in rows if r["capacity_blocks"] == capacities[-1]}
    others = [p for p in top if p != BASELINE]
    x_lru = {p: top[p]["us_per_ref"]["x_lru"] for p in others}
    o1 = {p: top[p]["us_per_ref"]["x_small"] for p in top}
    worst = max(others, key=o1.__getitem__)
    extra = {p: top[p]["extra_bytes_per_block_vs_lru"] for p in others}
    summary = {
        "capacities_blocks": capacities,
        "us_per_ref_x_lru": x_lru,
        "o1_ratio": o1,
        "o1_ratio_max": o1[worst],
        "o1_ratio_max_policy": worst,
        "lru_bytes_per_block": top[BASELINE]["bytes_per_block"],
        "extra_bytes_per_block_vs_lru": extra,
    }
    big, small = label(capacities[-1]), label(capacities[0])
    line = (
        f"bench_policies: µs per block reference x lru at {big} blocks: "
        + ", ".join(f"{p} {v:.2f}x" for p, v in x_lru.items())
        + f"; O(1) {big}/{small} max {o1[worst]:.2f}x ({worst}; lru {o1[BASELINE]:.2f}x)"
        + f"; bytes/block lru {top[BASELINE]['bytes_per_block']:.0f}, "
        + ", ".join(f"{p} {v:+.0f}" for p, v in extra.items())
    )
    return summary, line


def policy_name(text: str) -> str:
    """An argparse type: a policy spec (`arc`, `lru+door`), canonical."""
    try:
        return PolicySpec.parse(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def reuse_fraction(text: str) -> float:
    """An argparse type: a fraction in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--policy",
        type=policy_name,
        action="append",
        help=f"a policy to measure, repeatable; lru is always added"
        f" (default: {', '.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument(
        "--capacity",
        type=positive_int,
        help=f"the small tier size in usable blocks; the large one is {SCALE}x"
        f" (default: {DEFAULTS['capacity']}, --quick {QUICK['capacity']})",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        help=f"requests per tier per rep (default: {DEFAULTS['requests']},"
        f" --quick {QUICK['requests']})",
    )
    parser.add_argument(
        "--reps",
        type=positive_int,
        help=f"timed repetitions (default: {DEFAULTS['reps']}, --quick {QUICK['reps']})",
    )
    parser.add_argument(
        "--blocks-per-request", type=positive_int, default=8, help="blocks of each request"
    )
    parser.add_argument(
        "--reuse", type=reuse_fraction, default=0.5, help="share of requests reusing a prefix"
    )
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="random seed")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="timer: this thread's CPU time (steadier on shared cores: the spread of a"
        " rep was ±10%% with it, up to 3x with wall time, on 2 busy cores) or wall time",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run (a few seconds): " + ", ".join(f"--{k} {v}" for k, v in QUICK.items()),
    )
    parser.add_argument("--json", type=output_file, help="write every number to this file")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    policies = args.policy or DEFAULT_POLICIES
    args.policy = [BASELINE, *dict.fromkeys(p for p in policies if p != BASELINE)]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    capacities = [args.capacity, SCALE * args.capacity]
    machine = machine_info()
    load = machine["load_average"]
    print(
        f"bench_policies: {machine['cpus_usable']} cores, {machine['implementation']}"
        f" {machine['python']}, load {load[0] if load else 'n/a'}; capacities"
        f" {label(capacities[0])} and {label(capacities[1])} blocks, {args.blocks_per_request}"
        f" blocks/request, reuse {args.reuse}; {args.requests} requests/tier/rep, median of"
        f" {args.reps} reps, {args.clock} clock; x lru = paired ratio to lru, O(1) = paired"
        f" ratio to the same policy at {label(capacities[0])}; B/block = getsizeof of all"
        f" the tier owns after 2 x capacity stores, key objects included",
        flush=True,
    )
    read_ns = clock_read_ns(CLOCKS[args.clock])
    per_ref = 3 * read_ns / args.blocks_per_request / 1e3
    print(
        f"clock read {read_ns:.0f} ns, subtracted once per timed interval (3 per request,"
        f" {per_ref:.2f} µs per block reference)"
    )
    t0 = time.perf_counter()
    tiers = build_tiers(args, capacities)
    reps = time_tiers(args, tiers, read_ns)
    rows = collect(tiers, reps, capacities)
    print_table(rows)
    summary, line = summarize(rows, capacities)
    print(f"total {time.perf_counter() - t0:.0f} s")
    print(line)
    if args.json:
        payload = {"machine": machine, "args": vars(args), "rows": rows, "summary": summary}
        payload["clock_read_ns"] = read_ns
        payload["summary_line"] = line
        args.json.write_text(json.dumps(payload, indent=2, default=str))


if __name__ == "__main__":
    main()
