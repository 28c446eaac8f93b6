"""vLLM connector overhead: µs per step inside kvtier's connector vs vLLM's own offload connector.

Two real vLLM 0.33 `Scheduler`s run the same seeded request stream side by side, one step
each in turn: (a) with `KVTierConnector`, whose worker role runs on the harness's CPU "GPU"
tensors, and (b) with vLLM's `SimpleCPUOffloadConnector`, whose worker needs CUDA, so the
test harness's stand-in worker (`FakeSimpleOffloadWorker`: same metadata, plain copies)
runs in its place. The stand-in reports a store one step after it was submitted, as
vLLM's CUDA worker does: `wait_for_save` launches the copy behind a compute-done event
and `get_finished` polls it right after, before the copy ran. (Reported in the same step
instead, a quick lazy run of vLLM stored 7924 blocks, not 9423, and served 5120 hit
tokens, not 7168, and the lazy ratio read 2.5x, not 1.5x.) Loads complete in their step.
The model runner is the harness's fake (no fingerprint checks here).
kvtier's worker copies on its own threads. By default (`--copies steps`) the harness's
`FaultyWorker`, injecting no faults, makes it wait for its copies at each poll and report
them as the stand-in does: a load in its step, a store one step later. Left to its threads
(`--copies threads`, as until 2026-12-05), a copy is reported at the first poll after its
thread finished it; which step that is depends on the OS, and it changes what the
scheduler does next (a request waits a step more for its load, a block stays pinned and
its copy unserved a step more), so the same code served different hit tokens run to run
(lazy, 256 requests: 56320-59392 in 8 runs, eager 52512-55584); with the copies stepped,
every run is the same, under any PYTHONHASHSEED.
The harness sets the GIL switch interval to 0.2 ms: its engine loop never releases the
GIL (a GPU engine does, waiting on the device), so kvtier's copy threads would otherwise
lag 5 ms per handoff, and the kvtier engine took up to 30x the steps of vLLM's
synchronous stand-in.

Workload: 256 requests of 2048-token prompts (16-token blocks); half start with one of
32 shared 1024-token system prefixes, half are unique; 16-64 output tokens; all queued at
once in a shuffled order; 32 running at most, 4096 tokens per step (chunked prefill). The
GPU pool holds the running set plus ~15 %, too little for the 32 prefixes, so they are
evicted and come back from the CPU tier (4x the GPU pool, the same for both).

Measured: the time spent inside the connector's scheduler-role methods, each wrapped by
a timer (lookup, allocation, metadata, output, finish, events, stats, push work, ...),
per engine step; the ratio kvtier / vLLM per window of steps (median, min-max); the
external hit tokens each connector served; and the GPU blocks each chose to store, with
its connector time per stored block (the modes store different amounts: kvtier's lazy
walk resumes after the last block it visited and did not select, vLLM's after the last
one it visited, which a completed store has moved to the free queue's MRU end:
docs/vllm.md). Eager and lazy store modes are run as pairs. The default clock is this
thread's CPU time (the scheduler side is single-threaded Python; the machines are shared
and busy). Reading it costs microseconds on some VMs, so the cost one timed call of a
no-op adds (measured at start, the least of 20 batches) is subtracted from every call on
both sides. The garbage collector is frozen after set-up and off while stepping (`--gc
on` keeps it on): a collection is paid by whichever call happens to allocate, so with
two engines in one process its cost would land on either connector at random.

Run (the vLLM venv, see mk/vllm.mk):
`VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
.venv-vllm/bin/python benchmarks/bench_vllm_connector.py [--quick] [--json PATH]`;
`--token-check --modes eager` measures kvtier with its token check on (SPEC §3 Beyond),
`--policy duel` with another tier policy.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "adapters"))

import torch

from call_timer import CallTimer, clock_overhead_ns
from kvtier.offload.plan import Tier
from vllm_connector_options import CLOCKS, DEFAULTS, QUICK, kvtier_extra_config
from vllm_connector_options import build_parser as options_parser

try:  # --help and option errors need no vLLM; a run does (`make bench-vllm`)
    from faulty_worker import FaultyWorker
    from kvtier_vllm import offload_worker
    from vllm_harness import (
        SIMPLE_CPU_OFFLOAD,
        HarnessConfig,
        VllmHarness,
        connector_worker_factory,
        simple_offload_worker_factory,
    )
except ModuleNotFoundError as exc:
    VLLM_MISSING: ModuleNotFoundError | None = exc
else:
    VLLM_MISSING = None

BLOCK_SIZE = 16
SLOT_BYTES = 2 * 2048  # one block id of the harness model: 2 layers x 2048-byte pages
CONNECTORS = ("kvtier", "vllm")
# Every scheduler-role method vLLM's Scheduler calls on a connector.
SCHEDULER_METHODS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "has_pending_block_frees",
    "take_events",
    "get_kv_connector_stats",
)


@dataclass
class Run:
    """One engine with one connector, instrumented.

    `stored_blocks` counts the GPU blocks the connector chose to copy down (one-element
    list, added to by `count_stores`' wrapper).
    """

    harness: VllmHarness
    connector: CallTimer
    scheduler: CallTimer
    num_steps: int = 0
    stored_blocks: list[int] = field(default_factory=lambda: [0])

    @property
    def busy(self) -> bool:
        return bool(self.harness.scheduler.has_requests())


def workload(num_requests: int, seed: int) -> list[tuple[str, list[int], int]]:
    """Return (request id, prompt, max tokens) in arrival order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(1024)] for _ in range(32)]
    requests = []
    for i in range(num_requests):
        if i % 2 == 0:
            prompt = prefixes[(i // 2) % len(prefixes)] + [
                rng.randrange(1000, 30000) for _ in range(1024)
            ]
        else:
            prompt = [rng.randrange(1000, 30000) for _ in range(2048)]
        requests.append((f"req-{i}", prompt, rng.randint(16, 64)))
    rng.shuffle(requests)
    return requests


def build(connector: str, mode: str, args: argparse.Namespace) -> Run:
    """Return a harness with `connector` in store `mode`, its connector and scheduler timed."""
    num_running = 32
    num_gpu_blocks = int(num_running * (2048 + 64) / BLOCK_SIZE * 1.15)
    tier_bytes = 4 * num_gpu_blocks * SLOT_BYTES
    common = {
        "num_gpu_blocks": num_gpu_blocks,
        "max_num_seqs": num_running,
        "max_num_batched_tokens": 4096,
        "max_model_len": 4096,
        "block_size": BLOCK_SIZE,
    }
    if connector == "kvtier":
        cfg = HarnessConfig(
            connector="KVTierConnector",
            connector_module="kvtier.adapters.vllm",
            extra_config=kvtier_extra_config(tier_bytes, mode, args),
            kv_load_failure_policy="recompute",
            **common,
        )
        harness = VllmHarness(cfg, connector_worker_factory, check_kv=False)
        if args.copies == "steps":
            worker = FaultyWorker(offload_worker(harness), lambda block_ids: None)
            worker.hold["store"] = 1  # loads: 0, reported in their step
    else:
        cfg = HarnessConfig(
            connector=SIMPLE_CPU_OFFLOAD,
            extra_config={"cpu_bytes_to_use": tier_bytes, "lazy_offload": mode == "lazy"},
            **common,
        )
        harness = VllmHarness(cfg, simple_offload_worker_factory(store_delay=1), check_kv=False)
    clock = CLOCKS[args.clock]
    connector_timer = CallTimer(clock, args.clock_overhead_ns)
    scheduler_timer = CallTimer(clock, args.clock_overhead_ns)
    connector_timer.wrap(harness.scheduler.connector, SCHEDULER_METHODS)
    scheduler_timer.wrap(harness.scheduler, ("schedule", "update_from_output"))
    run = Run(harness, connector_timer, scheduler_timer)
    count_stores(connector, harness.scheduler.connector, run.stored_blocks)
    return run


def count_stores(connector: str, instance: Any, total: list[int]) -> None:
    """Add the GPU blocks each store selection of `instance` picks to `total[0]`.

    kvtier: the blocks of its plan's GPU -> tier job; vLLM: the GPU ids its manager's
    `prepare_store_specs` returns. One extra Python call per step on either side.
    """
    if connector == "kvtier":
        offload = instance._scheduler.offload
        build_plan = offload.build_plan

        def counted_plan(step: Any) -> Any:
            plan = build_plan(step)
            total[0] += sum(len(job.src_block_ids) for job in plan.jobs if job.src_tier is Tier.GPU)
            return plan

        offload.build_plan = counted_plan
    else:
        manager = instance.scheduler_manager
        prepare = manager.prepare_store_specs

        def counted_specs(scheduler_output: Any) -> Any:
            specs = prepare(scheduler_output)
            total[0] += len(specs[0])
            return specs

        manager.prepare_store_specs = counted_specs


def run_pair(
    mode: str, requests: list[tuple[str, list[int], int]], args: argparse.Namespace
) -> dict:
    """Step both engines in turn until idle; return per-window and total numbers."""
    runs = {name: build(name, mode, args) for name in CONNECTORS}
    for run in runs.values():
        for request_id, prompt, max_tokens in requests:
            run.harness.add_request(request_id, prompt, max_tokens)
    gc.collect()
    gc.freeze()
    if args.gc == "off":
        gc.disable()
    windows: list[dict[str, float]] = []
    marks: dict[str, tuple[float, int]] = dict.fromkeys(CONNECTORS, (0.0, 0))
    order = list(runs.values())
    step = 0
    t0 = time.perf_counter()
    while any(run.busy for run in runs.values()):
        k = step % 2  # alternate which engine steps first
        for run in order[k:] + order[:k]:
            if run.busy:
                run.harness.step()
                run.num_steps += 1
        step += 1
        if step % args.window == 0 and all(run.busy for run in runs.values()):
            window = {}
            for name, run in runs.items():
                ns, steps = run.connector.total_ns, run.num_steps
                window[name] = (ns - marks[name][0]) / (steps - marks[name][1]) / 1e3
                marks[name] = (ns, steps)
            window["ratio"] = window["kvtier"] / window["vllm"]
            windows.append(window)
    elapsed = time.perf_counter() - t0
    gc.enable()
    gc.unfreeze()
    result: dict[str, Any] = {"mode": mode, "elapsed_s": elapsed, "windows": windows}
    for name, run in runs.items():
        h = run.harness
        assert h.finished == {r for r, _, _ in requests}, f"{name}: requests left unfinished"
        connector_us = run.connector.total_ns / run.num_steps / 1e3
        # The scheduler's own time: less the connector calls inside it, timing included.
        scheduler_us = (
            (run.scheduler.total_ns - sum(run.connector.ns.values())) / run.num_steps / 1e3
        )
        result[name] = {
            "num_steps": run.num_steps,
            "connector_us_per_step": connector_us,
            "scheduler_us_per_step_excluding_connector": scheduler_us,
            "connector_us_per_call": {
                m: run.connector.method_ns(m) / run.connector.calls[m] / 1e3
                for m in SCHEDULER_METHODS
                if run.connector.calls[m]
            },
            "connector_us_per_step_by_method": {
                m: run.connector.method_ns(m) / run.num_steps / 1e3 for m in SCHEDULER_METHODS
            },
            "stored_blocks": run.stored_blocks[0],
            "connector_us_per_stored_block": run.connector.total_ns / run.stored_blocks[0] / 1e3,
            "external_hit_tokens": sum(h.external_hit_tokens(r) for r, _, _ in requests),
            "local_hit_tokens": sum(h.local_hit_tokens(r) for r, _, _ in requests),
        }
    for run in runs.values():
        run.harness.close()
    result["ratio_total"] = (
        result["kvtier"]["connector_us_per_step"] / result["vllm"]["connector_us_per_step"]
    )
    return result


def median_spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def print_mode(mode: str, reps: list[dict]) -> dict:
    """Print one store mode's numbers over its repetitions; return its summary."""
    ratios = [w["ratio"] for r in reps for w in r["windows"]]
    summary = {
        "window_ratio": median_spread(ratios),
        "total_ratio": median_spread([r["ratio_total"] for r in reps]),
    }
    print(f"\n{mode}: {len(reps)} runs, {len(ratios)} windows")
    print(
        f"  {'connector':9} {'µs/step':>9} {'sched µs/step':>13} {'steps':>6}"
        f" {'stored':>7} {'µs/stored':>9} {'external hit tokens':>20} {'local':>8}"
        "  top methods µs/step"
    )
    for name in CONNECTORS:
        us = statistics.median(r[name]["connector_us_per_step"] for r in reps)
        sched = statistics.median(
            r[name]["scheduler_us_per_step_excluding_connector"] for r in reps
        )
        ext = statistics.median(r[name]["external_hit_tokens"] for r in reps)
        local = statistics.median(r[name]["local_hit_tokens"] for r in reps)
        steps = statistics.median(r[name]["num_steps"] for r in reps)
        stored = statistics.median(r[name]["stored_blocks"] for r in reps)
        per_stored = statistics.median(r[name]["connector_us_per_stored_block"] for r in reps)
        by = reps[0][name]["connector_us_per_step_by_method"]
        top = sorted(by.items(), key=lambda kv: -kv[1])[:3]
        tops = " ".join(f"{m}={v:.0f}" for m, v in top)
        print(
            f"  {name:9} {us:9.0f} {sched:13.0f} {steps:6.0f} {stored:7.0f} {per_stored:9.1f}"
            f" {ext:20.0f} {local:8.0f}  {tops}"
        )
        summary[f"{name}_us_per_step"] = us
        summary[f"{name}_stored_blocks"] = stored
        summary[f"{name}_us_per_stored_block"] = per_stored
        summary[f"{name}_external_hit_tokens"] = ext
    w, t = summary["window_ratio"], summary["total_ratio"]
    print(
        f"  kvtier/vLLM connector time: windows {w['median']:.2f}x"
        f" [{w['min']:.2f}-{w['max']:.2f}], whole runs {t['median']:.2f}x"
    )
    return summary


def build_parser() -> argparse.ArgumentParser:
    return options_parser(__doc__)


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.token_check and "lazy" in args.modes:
        parser.error("--token-check needs eager stores: add --modes eager")
    if VLLM_MISSING is not None:
        parser.error(f"needs vLLM ({VLLM_MISSING}): run it in the vLLM venv, `make bench-vllm`")
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    torch.set_num_threads(1)
    args.clock_overhead_ns = clock_overhead_ns(CLOCKS[args.clock])
    logging.getLogger("vllm").setLevel(logging.ERROR)  # per-engine start-up notes
    machine = {
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
        "clock_overhead_ns_per_call": args.clock_overhead_ns,
    }
    print(
        f"bench_vllm_connector: {machine['cpus_usable']} cores, torch threads"
        f" {machine['torch_threads']}, load {machine['load_avg_at_start'][0]:.1f};"
        f" {args.num_requests} requests x {args.reps} runs per mode, seed {args.seed},"
        f" clock {args.clock} ({args.clock_overhead_ns:.0f} ns per timed call, subtracted),"
        f" gc {args.gc}, kvtier policy {args.policy}"
        + (", kvtier token check on" if args.token_check else "")
    )
    requests = workload(args.num_requests, args.seed)
    results: dict[str, list[dict]] = {}
    summaries = {}
    for mode in args.modes:
        results[mode] = [run_pair(mode, requests, args) for _ in range(args.reps)]
        summaries[mode] = print_mode(mode, results[mode])
    parts = []
    for mode, s in summaries.items():
        parts.append(
            f"{mode} {s['window_ratio']['median']:.2f}x"
            f" (hit tokens kvtier {s['kvtier_external_hit_tokens']:.0f}"
            f" / vLLM {s['vllm_external_hit_tokens']:.0f}; µs per stored block"
            f" {s['kvtier_us_per_stored_block']:.1f} / {s['vllm_us_per_stored_block']:.1f})"
        )
    line = (
        "bench_vllm_connector: connector time kvtier/vLLM " + ", ".join(parts) + " (target <= 0.5x)"
    )
    print(f"\n{line}")
    if args.json:
        payload = {
            "machine": machine,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": results,
            "summary": summaries,
            "summary_line": line,
        }
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
