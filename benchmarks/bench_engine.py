"""End-to-end benchmark (SPEC scenario 32): multi-turn chat, offload on vs off.

Runs the demo workload on the reference engine with offload off and through the CPU tier
(and the disk tier with --disk), side by side in one process, repeated --reps times.
Reports the TTFT of turns whose history had left the GPU pool as a ratio to offload off
(target <= 0.25x) and the throughput ratio. A progress bar (stderr, a terminal only) counts
each run's requests; it moves between requests, and its time is left out of the run's wall
time (`run_chat`'s `on_request`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile

import torch

from bench_common import new_parser, output_file, positive_int
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
        "--reps", type=positive_int, default=2, help="repetitions (median reported)"
    )
    parser.add_argument(
        "--conversations", type=positive_int, default=8, help="conversations per run"
    )
    parser.add_argument("--turns", type=positive_int, default=6, help="turns per conversation")
    parser.add_argument(
        "--gpu-blocks", type=positive_int, default=96, help="GPU pool blocks (null block included)"
    )
    parser.add_argument("--disk", action="store_true", help="also run the disk tier")
    parser.add_argument("--json", type=output_file, help="write every number here")
    return parser


def main() -> None:
    """Run the benchmark and print its table and summary line."""
    parser = build_parser()
    args = parser.parse_args()
    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, python {platform.python_version()}"
    )
    model = ModelConfig.demo()
    workload = ChatWorkload(args.conversations, args.turns, vocab_size=model.vocab_size)
    try:
        engine = EngineConfig(num_gpu_blocks=args.gpu_blocks)
    except ValueError as exc:
        parser.error(f"argument --gpu-blocks: {exc}")
    numbers: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        configs: list[tuple[str, OffloadConfig | None]] = [
            ("off", None),
            ("cpu", OffloadConfig(cpu_bytes=256 * MIB)),
        ]
        if args.disk:
            disk = OffloadConfig(
                disk_bytes=256 * MIB,
                disk_path=tmp,
                disk_io_mode=DiskIOMode.PAGE_CACHE,
            )
            configs.append(("disk", disk))
        with LLM(model, engine=engine) as warm:  # warm up kernels and allocator
            try:  # the pool holds a last turn (the warm-up's turns are shorter)
                check_sizes(workload, [], warm.layout, args.gpu_blocks)
            except ValueError as exc:
                parser.error(str(exc))
            run_chat(warm, ChatWorkload(2, 2, 64, 64, vocab_size=model.vocab_size), "warm-up")
        num_requests = args.conversations * args.turns
        for rep in range(args.reps):
            for name, offload in configs:
                with (
                    progress_bar(num_requests, unit="req", desc=f"rep {rep}: {name}") as bar,
                    LLM(model, kv_offload=offload, engine=engine) as llm,
                ):
                    result = run_chat(llm, workload, name, on_request=bar.update)
                _record(numbers.setdefault(name, {}), result)
                print(f"rep {rep}: {name:4s} wall {result.wall_s:6.2f}s")
    summary = _report(numbers)
    if args.json:
        args.json.write_text(json.dumps({"runs": numbers, "summary": summary}, indent=2))


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
