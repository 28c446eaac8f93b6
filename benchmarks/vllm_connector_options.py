"""`bench_vllm_connector.py`'s options: store modes, clocks, run sizes, kvtier's config."""

from __future__ import annotations

import argparse
import time

from bench_common import new_parser, nonnegative_int, output_file, positive_int
from kvtier.core.policies import PolicySpec

MODES = ("eager", "lazy")
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
DEFAULTS = {"num_requests": 256, "reps": 3, "window": 50}
QUICK = {"num_requests": 96, "reps": 2, "window": 25}


def store_modes(text: str) -> list[str]:
    """An argparse type: a comma list of store modes (`eager,lazy`)."""
    modes = text.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(
            f"expected a comma list of distinct modes from {', '.join(MODES)}, got {text!r}"
        )
    return modes


def tier_policy(text: str) -> str:
    """An argparse type: kvtier's tier policy, `EVICTION[+ADMISSION]` (`duel`, `lru+door`)."""
    try:
        return PolicySpec.parse(text).name
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def kvtier_extra_config(tier_bytes: int, mode: str, args: argparse.Namespace) -> dict:
    """Return kvtier's `kv_connector_extra_config` for a run in store `mode`."""
    return {
        "cpu_bytes": tier_bytes,
        "store_mode": mode,
        "token_check": args.token_check,
        "policy": args.policy,
    }


def build_parser(doc: str | None) -> argparse.ArgumentParser:
    """Return the benchmark's parser; `doc` is the script's docstring."""

    def default(key: str) -> str:
        return f"(default {DEFAULTS[key]}, with --quick {QUICK[key]})"

    parser = new_parser(doc)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--json", type=output_file, help="write every number to this file")
    parser.add_argument(
        "--num-requests", type=positive_int, help=f"requests per run {default('num_requests')}"
    )
    parser.add_argument("--reps", type=positive_int, help=f"runs per store mode {default('reps')}")
    parser.add_argument(
        "--window", type=positive_int, help=f"steps per ratio window {default('window')}"
    )
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed")
    parser.add_argument(
        "--modes", type=store_modes, default=list(MODES), help="store modes, a comma list"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this thread's CPU time (default); wall: perf_counter_ns",
    )
    parser.add_argument(
        "--token-check",
        action="store_true",
        help="run kvtier with its token check on (eager mode only: pass --modes eager)",
    )
    parser.add_argument(
        "--policy",
        type=tier_policy,
        default="lru",
        help="kvtier's tier policy, EVICTION[+ADMISSION] (default lru; vLLM's connector"
        " evicts LRU)",
    )
    parser.add_argument(
        "--copies",
        choices=("steps", "threads"),
        default="steps",
        help="steps (default): kvtier's worker waits for its copies at each poll and"
        " reports a load in its step, a store one step later, as vLLM's stand-in does,"
        " so runs repeat exactly; threads: each copy is reported at the first poll after"
        " its copy thread finished it, which varies run to run",
    )
    parser.add_argument(
        "--gc",
        choices=("on", "off"),
        default="off",
        help="keep the garbage collector on while stepping",
    )
    return parser
