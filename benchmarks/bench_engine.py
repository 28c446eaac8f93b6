"""End-to-end benchmark (SPEC scenario 32): multi-turn chat, offload on vs off.

Runs the demo workload on the reference engine with offload off and through the CPU tier
(and the disk tier with --disk), side by side in one process, repeated --reps times.

Steady state: first every configuration serves a warm-up pass, not counted (the workload's
turns for --warmup-conversations conversations: its longest prompts, so the heap, its
pages and the kernels of those shapes are warm); then the measured reps alternate the
order of the configurations (off, cpu; cpu, off; ...), so no configuration always runs
right after another's teardown. Torch runs --threads intra-op threads: with an OpenMP team
as large as a shared machine's cores, a run stalls each time another process takes a
core from one of the team (on 2 busy cores the same run took 3 s or 38 s with 2 threads,
6.5-8.5 s with 1).

Reports the TTFT of turns whose history had left the GPU pool as a ratio to offload off
(target <= 0.25x) and the throughput ratio. A progress bar (stderr, a terminal only) counts
each run's requests; it moves between requests, and its time is left out of the run's wall
time (`run_chat`'s `on_request`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile

import torch

from bench_common import new_parser, nonnegative_int, output_file, positive_int
from kvtier.cli.demo_checks import check_sizes
from kvtier.engine.chat_workload import ChatWorkload, RunResult, percentile, run_chat
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.offload.config import DiskIOMode, OffloadConfig
from progress_bar import progress_bar

MIB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--reps",
        type=positive_int,
        default=2,
        help="measured repetitions, the configurations in alternating order (median reported)",
    )
    parser.add_argument(
        "--conversations", type=positive_int, default=8, help="conversations per run"
    )
    parser.add_argument("--turns", type=positive_int, default=6, help="turns per conversation")
    parser.add_argument(
        "--gpu-blocks", type=positive_int, default=96, help="GPU pool blocks (null block included)"
    )
    parser.add_argument("--disk", action="store_true", help="also run the disk tier")
    parser.add_argument(
        "--warmup-conversations",
        type=nonnegative_int,
        default=2,
        help="conversations of each configuration's uncounted warm-up pass (0: none)",
    )
    parser.add_argument(
        "--threads",
        type=nonnegative_int,
        default=1,
        help="torch intra-op threads (0: torch's default, one per core)",
    )
    parser.add_argument("--json", type=output_file, help="write every number here")
    return parser


def main() -> None:
    """Run the benchmark and print its table and summary line."""
    parser = build_parser()
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, python {platform.python_version()}; "
        f"warm-up: {args.warmup_conversations} conversations per configuration, not counted; "
        "measured reps alternate the configurations' order"
    )
    model = ModelConfig.demo()
    workload = ChatWorkload(args.conversations, args.turns, vocab_size=model.vocab_size)
    try:
        engine = EngineConfig(num_gpu_blocks=args.gpu_blocks)
    except ValueError as exc:
        parser.error(f"argument --gpu-blocks: {exc}")
    numbers: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        configs: dict[str, OffloadConfig | None] = {
            "off": None,
            "cpu": OffloadConfig(cpu_bytes=256 * MIB),
        }
        if args.disk:
            configs["disk"] = OffloadConfig(
                disk_bytes=256 * MIB,
                disk_path=tmp,
                disk_io_mode=DiskIOMode.PAGE_CACHE,
            )
        with LLM(model, engine=engine) as llm:
            try:  # the pool holds a last turn
                check_sizes(workload, [], llm.layout, args.gpu_blocks)
            except ValueError as exc:
                parser.error(str(exc))
        if args.warmup_conversations:
            warmup = dataclasses.replace(workload, num_conversations=args.warmup_conversations)
            for name, offload in configs.items():
                result = _serve(model, engine, offload, warmup, f"warm-up: {name}")
                print(f"warm-up: {name:4s} wall {result.wall_s:6.2f}s (not counted)")
        for rep, name in run_order(list(configs), args.reps):
            result = _serve(model, engine, configs[name], workload, f"rep {rep}: {name}")
            _record(numbers.setdefault(name, {}), result)
            print(f"rep {rep}: {name:4s} wall {result.wall_s:6.2f}s")
    summary = _report({name: numbers[name] for name in configs})
    if args.json:
        args.json.write_text(json.dumps({"runs": numbers, "summary": summary}, indent=2))


def run_order(names: list[str], reps: int) -> list[tuple[int, str]]:
    """Return the measured runs as (rep, configuration): even reps in `names` order, odd
    reps reversed, so each configuration runs as often first as last, right after the
    same others (its share of a cold or noisy stretch is the same)."""
    return [(rep, name) for rep in range(reps) for name in names[:: -1 if rep % 2 else 1]]


def _serve(
    model: ModelConfig,
    engine: EngineConfig,
    offload: OffloadConfig | None,
    workload: ChatWorkload,
    desc: str,
) -> RunResult:
    """Serve `workload` on a fresh engine with `offload`, counting requests on a bar."""
    num_requests = workload.num_conversations * workload.num_turns
    with (
        progress_bar(num_requests, unit="req", desc=desc) as bar,
        LLM(model, kv_offload=offload, engine=engine) as llm,
    ):
        return run_chat(llm, workload, desc, on_request=bar.update)


def _record(into: dict[str, list[float]], result: RunResult) -> None:
    values = {
        "ttft_p50_s": percentile(result.ttfts(), 0.5),
        "ttft_p90_s": percentile(result.ttfts(), 0.9),
        "ttft_history_off_gpu_p50_s": percentile(result.ttfts(history_left_gpu=True), 0.5),
        "tokens_per_s": result.tokens_per_s,
        "tier_hit_tokens": float(sum(t.num_external_hit_tokens for t in result.turns)),
        "gpu_hit_tokens": float(sum(t.num_local_hit_tokens for t in result.turns)),
        "num_history_off_gpu_turns": float(len(result.ttfts(history_left_gpu=True))),
    }
    for key, value in values.items():
        into.setdefault(key, []).append(value)


def _report(numbers: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    def med(name: str, key: str) -> float:
        return statistics.median(numbers[name][key])

    print(f"{'config':6s} {'TTFT p50':>10s} {'p90':>8s} {'off-GPU p50':>12s} {'tok/s':>8s} "
          f"{'tier hits':>10s}")  # fmt: skip
    for name in numbers:
        print(
            f"{name:6s} {med(name, 'ttft_p50_s') * 1e3:8.1f}ms "
            f"{med(name, 'ttft_p90_s') * 1e3:6.1f}ms "
            f"{med(name, 'ttft_history_off_gpu_p50_s') * 1e3:10.1f}ms "
            f"{med(name, 'tokens_per_s'):8.0f} {med(name, 'tier_hit_tokens'):10.0f}"
        )
    summary: dict[str, float | None] = {}
    parts = []
    for name in numbers:
        if name == "off":
            continue
        off_gpu = med("off", "ttft_history_off_gpu_p50_s")
        ratio = med(name, "ttft_history_off_gpu_p50_s") / off_gpu if off_gpu else None
        summary[f"{name}_ttft_off_gpu_ratio"] = ratio
        summary[f"{name}_throughput_ratio"] = med(name, "tokens_per_s") / med("off", "tokens_per_s")
        parts.append(
            f"{name}: TTFT (history off GPU) {'n/a' if ratio is None else f'{ratio:.2f}x'}, "
            f"throughput {summary[f'{name}_throughput_ratio']:.2f}x"
        )
    print("bench_engine: " + "; ".join(parts) + " vs offload off (target TTFT <= 0.25x)")
    if any(value is None for value in summary.values()):
        print(
            "(n/a: no turn's history left the GPU pool; use more --conversations or fewer"
            " --gpu-blocks)"
        )
    return summary


if __name__ == "__main__":
    main()
