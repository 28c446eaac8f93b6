"""Scheduler overhead: µs per engine step spent in kvtier's scheduler side.

Drives `engine_loop.EngineLoop` three ways side by side — offload off, eager, lazy — on
the same seeded request stream: N running requests, 16-token blocks, ~2 k-token prompts
(half behind one of N shared system prefixes, Zipf popularity), 32-256 output tokens,
chunked prefill under a 16 x N token budget, finishes and new arrivals (closed loop), a GPU
pool only ~10 % larger than the running set at 256 (so idle prefixes are evicted and come back
from the tier), a CPU tier 4 x the GPU pool (pre-filled with cold blocks, as in a
long-running server, so tier evictions happen from the start), and a fake worker that
finishes every transfer one step later.

Reported per size: the engine loop's own scheduling time with offload off (everything the
loop does except kvtier calls, the fake worker and request arrival), kvtier's time in
eager and lazy mode (lookup, on_allocated, building the StepInput, build_plan,
apply_report, on_finished, take_stats) and their ratio, per step and per step and
request; external hit tokens and tier traffic to show the tier is used. One step of each
loop runs in turn (rotating order) so machine noise hits all modes alike; ratios are
paired per window; median and min-max over windows are printed. A progress bar (stderr, a
terminal only) counts the rounds of steps; it moves between rounds, outside the loops' timers.

Run: `python benchmarks/bench_scheduler.py [--quick] [--json PATH] [--clock cpu]`.
`--vllm` (first): the loop in vLLM 0.33's Scheduler, kvtier's connector against vLLM's
SimpleCPUOffloadConnector (`bench_vllm_connector.py`; `make bench-vllm` runs it so).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (
    machine_info,
    new_parser,
    nonnegative_int,
    output_file,
    output_range,
    positive_int,
    positive_int_list,
)
from engine_loop import (
    KV_CALLS,
    EngineConfig,
    EngineLoop,
    Workload,
    WorkloadConfig,
)
from kvtier.core.block_pool import BlockPool
from kvtier.core.hashing import BlockHasher
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.offload.config import OffloadConfig, StoreMode
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from progress_bar import progress_bar

MODES = ("off", "eager", "lazy")
BLOCK_SIZE = 16
# Llama-3-8B-shaped: 32 layers x (K + V) x 8 KV heads x 128 dims x fp16 x 16 tokens = 2 MiB.
BYTES_PER_BLOCK = 32 * 2 * 8 * 128 * 2 * BLOCK_SIZE
TOKENS_PER_SEQ = 16  # token budget per step = 16 x max_num_seqs (4096 at 256)
# GPU pool = 120 blocks per running request + 1024: the running set needs ~110 per request
# (prefix sharing included), so ~10 % is left as prefix cache; the 1024 keep small
# engines from preempting.
GPU_BLOCKS_PER_SEQ = 120
GPU_BLOCKS_EXTRA = 1024
TIER_FACTOR = 4  # CPU tier blocks per GPU block (host memory is usually several x GPU KV)
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
DEFAULTS = {"warmup": 400, "steps": 40, "reps": 5}
QUICK = {"warmup": 250, "steps": 15, "reps": 3}


def build_loop(
    num_running: int, mode: str, workload: Workload, args: argparse.Namespace
) -> EngineLoop:
    """Return a fresh engine loop of `num_running` requests with offload `mode`."""
    engine = EngineConfig(
        max_num_seqs=num_running,
        max_num_batched_tokens=args.tokens_per_seq * num_running,
        num_gpu_blocks=GPU_BLOCKS_PER_SEQ * num_running + GPU_BLOCKS_EXTRA,
        block_size=BLOCK_SIZE,
        waiting_depth=max(8, num_running // 16),
    )
    gpu = BlockPool(engine.num_gpu_blocks)
    sched = None
    if mode != "off":
        num_tier_blocks = TIER_FACTOR * engine.num_gpu_blocks
        config = OffloadConfig(
            cpu_bytes=num_tier_blocks * BYTES_PER_BLOCK,
            store_mode=StoreMode(mode),
            max_batched_tokens=engine.max_num_batched_tokens,
        )
        layout = KVLayout.single(BLOCK_SIZE, BYTES_PER_BLOCK)
        sched = OffloadScheduler(config, SchedulerSetup(layout, num_tier_blocks, gpu_pool=gpu))
        fill_with_cold_blocks(sched.tier_pool)
    return EngineLoop(engine, workload, sched, gpu, CLOCKS[args.clock])


def fill_with_cold_blocks(pool: BlockPool) -> None:
    """Give every tier slot a key no request has: tier allocations evict from step one."""
    blocks = pool.allocate(pool.num_usable_blocks)
    for block_id in blocks:
        key = make_key(b"cold" + block_id.to_bytes(28, "little"), 0)
        pool.insert_key(key, block_id, BLOCK_SIZE)
    pool.free(blocks)


def run_interleaved(
    loops: dict[str, EngineLoop], num_steps: int, on_step: Callable[[int], object]
) -> dict[str, dict]:
    """Step every loop `num_steps` times, one step each in turn, then `on_step(1)`; return
    per-mode numbers."""
    before = {mode: asdict(loop.counters) for mode, loop in loops.items()}
    for loop in loops.values():
        loop.reset_times()
    order = list(loops.values())
    for i in range(num_steps):
        k = i % len(order)  # rotate, so no mode always runs right after another
        for loop in order[k:] + order[:k]:
            loop.step()
        on_step(1)
    result = {}
    for mode, loop in loops.items():
        t = loop.times
        after = asdict(loop.counters)
        result[mode] = {
            "engine_us": t.engine_ns / num_steps / 1e3,
            "kvtier_us": t.kvtier_total_ns / num_steps / 1e3,
            "kvtier_calls_us": {k: v / num_steps / 1e3 for k, v in t.kvtier_ns.items()},
            "worker_us": t.worker_ns / num_steps / 1e3,
            "frontend_us": t.frontend_ns / num_steps / 1e3,
            "counters": {k: after[k] - before[mode][k] for k in after if isinstance(after[k], int)},
        }
    return result


def tier_summary(loop: EngineLoop) -> dict:
    """Return the cumulative tier use of an offload loop: hits, traffic, fill."""
    assert loop.sched is not None
    tier = loop.sched.tier_pool
    c = loop.counters
    return {
        "num_tier_blocks": tier.num_usable_blocks,
        "num_tier_blocks_cached": sum(tier.is_cached(b) for b in range(1, tier.num_blocks)),
        "hit_tokens_by_tier": dict(loop.sched.take_stats().hit_tokens),
        "external_hit_tokens": c.num_external_hit_tokens,
        "local_hit_tokens": c.num_local_hit_tokens,
        "num_loads": c.num_loads,
        "num_loaded_blocks": c.num_loaded_blocks,
        "num_stored_blocks": c.num_stored_blocks,
        "store_outcomes": dict(sorted(c.store_outcomes.items())),
    }


def median_spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def window_steps(num_running: int, args: argparse.Namespace) -> int:
    """Return the rounds of steps in one window at `num_running` requests."""
    return max(args.steps, args.steps * 256 // num_running)


def run_size(num_running: int, args: argparse.Namespace, on_step: Callable[[int], object]) -> dict:
    """Warm the three loops up, then time interleaved windows; return every number."""
    min_out, max_out = args.output_tokens
    workload_config = WorkloadConfig(
        seed=args.seed,
        block_size=BLOCK_SIZE,
        num_system_prefixes=num_running,
        min_output_tokens=min_out,
        max_output_tokens=max_out,
    )
    workload = Workload(workload_config, BlockHasher(BLOCK_SIZE))
    loops = {mode: build_loop(num_running, mode, workload, args) for mode in MODES}
    t0 = time.perf_counter()
    run_interleaved(loops, args.warmup, on_step)
    warmup_s = time.perf_counter() - t0
    gc.collect()
    gc.freeze()  # as engines do after start-up: long-lived objects leave the GC's way
    num_steps = window_steps(num_running, args)
    windows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    t0 = time.perf_counter()
    for _ in range(args.reps):
        for mode, numbers in run_interleaved(loops, num_steps, on_step).items():
            windows[mode].append(numbers)
    measure_s = time.perf_counter() - t0
    gc.unfreeze()
    for loop in loops.values():  # the loop drove kvtier by its contract: books agree
        loop.gpu.check_invariants()
        if loop.sched is not None:
            loop.sched.check_invariants()
    base = [w["engine_us"] for w in windows["off"]]
    result: dict = {
        "num_running": num_running,
        "num_steps_per_window": num_steps,
        "num_windows": args.reps,
        "warmup_s": warmup_s,
        "measure_s": measure_s,
        "engine_config": asdict(loops["off"].config),
        "workload_config": asdict(workload_config),
        "engine_off_us": median_spread(base),
        "engine_off_us_per_request": statistics.median(base) / num_running,
        "modes": {},
    }
    for mode in MODES:
        ws = windows[mode]
        steps = num_steps * len(ws)
        totals = {k: sum(w["counters"][k] for w in ws) for k in ws[0]["counters"]}
        entry = {
            "engine_us": median_spread([w["engine_us"] for w in ws]),
            "frontend_us": median_spread([w["frontend_us"] for w in ws]),
            "scheduled_tokens_per_step": totals["num_scheduled_tokens"] / steps,
            "window_counters": totals,
            "windows": ws,
        }
        if mode != "off":
            kv = [w["kvtier_us"] for w in ws]
            entry["kvtier_us"] = median_spread(kv)
            entry["kvtier_us_per_request"] = statistics.median(kv) / num_running
            entry["kvtier_calls_us"] = {
                c: statistics.median(w["kvtier_calls_us"][c] for w in ws) for c in KV_CALLS
            }
            entry["ratio_to_engine_off"] = median_spread(
                [k / b for k, b in zip(kv, base, strict=True)]
            )
            entry["stored_blocks_per_step"] = totals["num_stored_blocks"] / steps
            entry["tier"] = tier_summary(loops[mode])
        result["modes"][mode] = entry
    return result


def print_size(r: dict) -> None:
    n, off = r["num_running"], r["engine_off_us"]
    c = r["modes"]["off"]["window_counters"]
    print(
        f"\n{n} running: {r['num_windows']} windows x {r['num_steps_per_window']} steps;"
        f" engine loop, offload off: {off['median']:.0f} µs/step"
        f" [{off['min']:.0f}-{off['max']:.0f}]"
        f" = {r['engine_off_us_per_request']:.2f} µs/step/request;"
        f" {r['modes']['off']['scheduled_tokens_per_step']:.0f} tokens/step,"
        f" {c['num_chunked_prefills']} chunked prefills, {c['num_finished']} finished,"
        f" {c['num_preemptions']} preempted"
    )
    print(
        f"  {'mode':5} {'kvtier µs/step [min-max]':>25} {'µs/step/req':>11}"
        f" {'vs engine [min-max]':>22} {'stores/step':>11}  median µs/step per call"
    )
    for mode in MODES[1:]:
        e = r["modes"][mode]
        kv, ratio = e["kvtier_us"], e["ratio_to_engine_off"]
        calls = " ".join(f"{c}={v:.0f}" for c, v in e["kvtier_calls_us"].items())
        print(
            f"  {mode:5} {kv['median']:9.0f} [{kv['min']:6.0f}-{kv['max']:6.0f}]"
            f" {e['kvtier_us_per_request']:11.2f}"
            f" {ratio['median']:+7.0%} [{ratio['min']:+.0%}-{ratio['max']:+.0%}]"
            f" {e['stored_blocks_per_step']:11.0f}  {calls}"
        )
    for mode in MODES[1:]:
        t = r["modes"][mode]["tier"]
        print(
            f"  {mode:5} since start: external hit tokens {t['external_hit_tokens']}"
            f" (local {t['local_hit_tokens']}), {t['num_loads']} loads of"
            f" {t['num_loaded_blocks']} blocks, {t['num_stored_blocks']} blocks stored,"
            f" tier {t['num_tier_blocks_cached']}/{t['num_tier_blocks']} blocks cached"
        )


def summarize(results: list[dict]) -> tuple[dict, str]:
    """Return the summary ratios and the one summary line."""
    by_n = {r["num_running"]: r for r in results}
    sizes = sorted(by_n)
    ref = 256 if 256 in by_n else sizes[len(sizes) // 2]
    lo, hi = sizes[0], sizes[-1]
    summary: dict = {"reference_num_running": ref, "growth_from": lo, "growth_to": hi}
    for mode in MODES[1:]:
        summary[f"{mode}_ratio"] = by_n[ref]["modes"][mode]["ratio_to_engine_off"]["median"]
        summary[f"{mode}_per_request_growth"] = (
            by_n[hi]["modes"][mode]["kvtier_us_per_request"]
            / by_n[lo]["modes"][mode]["kvtier_us_per_request"]
        )
    summary["engine_per_request_growth"] = (
        by_n[hi]["engine_off_us_per_request"] / by_n[lo]["engine_off_us_per_request"]
    )
    for mode in MODES[1:]:  # > 1: kvtier's per-request cost grows faster than the engine's
        summary[f"{mode}_growth_relative_to_engine"] = (
            summary[f"{mode}_per_request_growth"] / summary["engine_per_request_growth"]
        )
    line = (
        f"bench_scheduler: eager {summary['eager_ratio']:+.0%} lazy {summary['lazy_ratio']:+.0%}"
        f" over the engine loop at {ref} requests (target <= 20%);"
        f" per-request cost {lo}->{hi}: eager {summary['eager_per_request_growth']:.2f}x"
        f" lazy {summary['lazy_per_request_growth']:.2f}x"
        f" (engine loop {summary['engine_per_request_growth']:.2f}x)"
    )
    return summary, line


def build_parser() -> argparse.ArgumentParser:
    quick = ", ".join(f"{k} {v}" for k, v in QUICK.items())
    parser = new_parser(__doc__)
    parser.add_argument(
        "--quick", action="store_true", help=f"a short run (about a minute: {quick})"
    )
    parser.add_argument("--json", type=output_file, help="write every number to this file")
    vllm_help = "first option only: the vLLM connector mode (options: --vllm --help)"
    parser.add_argument("--vllm", action="store_true", help=vllm_help)
    parser.add_argument(
        "--sizes",
        type=positive_int_list,
        default=[64, 256, 1024],
        help="running requests, a comma list",
    )
    parser.add_argument(
        "--warmup", type=positive_int, help=f"warm-up steps (default {DEFAULTS['warmup']})"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        help=f"steps per window at 256, more below 256 (default {DEFAULTS['steps']})",
    )
    parser.add_argument("--reps", type=positive_int, help=f"windows (default {DEFAULTS['reps']})")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: perf_counter_ns; cpu: this thread's CPU time (steadier on a busy"
        " machine; ~0.4 µs per reading)",
    )
    parser.add_argument(
        "--output-tokens",
        type=output_range,
        default=(32, 256),
        help="output length MIN,MAX",
    )
    parser.add_argument(
        "--tokens-per-seq",
        type=positive_int,
        default=TOKENS_PER_SEQ,
        help="token budget per request",
    )
    return parser


def main() -> None:
    if sys.argv[1:2] == ["--vllm"]:  # issue #8's mode, in vLLM's real Scheduler
        import bench_vllm_connector

        sys.argv[:2] = [f"{sys.argv[0]} --vllm"]
        bench_vllm_connector.main()
        return
    parser = build_parser()
    args = parser.parse_args()
    if args.vllm:
        parser.error("--vllm must come first (its options follow it)")
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    machine = machine_info()
    load_avg = machine["load_average"]
    print(
        f"bench_scheduler: {machine['cpus_usable']} cores, {machine['implementation']}"
        f" {machine['python']}, load average {load_avg[0]:.1f};"
        f" clock {args.clock}; warm-up {args.warmup} steps, {args.reps} windows of"
        f" >={args.steps} steps; seed {args.seed}"
    )
    t0 = time.perf_counter()
    results = []
    total = sum(args.warmup + args.reps * window_steps(n, args) for n in args.sizes)
    with progress_bar(total, unit="step") as bar:
        for n in args.sizes:
            bar.set_description(f"{n} running")
            results.append(run_size(n, args, bar.update))
    for r in results:
        print_size(r)
    summary, line = summarize(results)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)\n{line}")
    if args.json:
        payload = {
            "machine": machine,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": results,
            "summary": summary,
            "summary_line": line,
        }
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
