"""`kvtier replay TRACE`: replay a Mooncake-format trace through kvtier's tiers.

`main(argv)` is the command; `add_parser(subparsers)` mounts it under `kvtier`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.core.plural import counted
from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES
from kvtier.replay.config import CascadeMode, ReleaseOrder, ReplayError
from kvtier.replay.cost import DEFAULT_LINK_GBPS, CostModel
from kvtier.replay.option_types import (
    attach_dashed_values,
    block_size,
    bytes_per_token,
    parse_tokens,
    policy_name,
    rate,
    trace_path,
)
from kvtier.replay.outputs import (
    folder_output_path,
    folders_to_make,
    json_output_path,
    shell_word,
)
from kvtier.replay.plan import DEFAULT_OUT, ReplayPlan, plan_replay
from kvtier.replay.report import format_table
from kvtier.replay.stdout_lines import StdoutLines, progress_bar_disable
from kvtier.replay.store_once import StoreOnce
from kvtier.replay.sweep import (
    SweepPoint,
    plot_sweep,
    run_sweep,
    sweep_passes,
    write_csv,
    write_json,
)
from kvtier.replay.trace import DEFAULT_BLOCK_SIZE, TraceError, TraceSummary, summarize
from kvtier.replay.whole_file import descriptor_of, file_set, written_in_place

__all__ = ["add_parser", "configure", "format_table", "main", "parse_tokens", "run"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a reader that went away
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for Ctrl-C


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the replay options to `parser`."""
    parser.add_argument(
        "trace",
        type=trace_path,
        help="Mooncake-format .jsonl trace (or .jsonl.gz); - reads it from stdin",
    )
    parser.add_argument(
        "--policy",
        action="append",
        type=policy_name,
        metavar="NAME",
        help="lower-tier policy EVICTION[+ADMISSION], repeatable (default: lru). "
        f"Eviction: {', '.join(EVICTION_POLICIES)}; admission: "
        f"{', '.join(a for a in ADMISSION_POLICIES if a != 'all')}; or offline: 'belady' "
        "(evicts the block used again farthest ahead: the reference line, not a proof of "
        "optimality for prefix hits), 'oracle-lfu' (evicts the block with the fewest uses "
        "left)",
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
        action=StoreOnce,
        type=parse_tokens,
        default=0,
        metavar="TOKENS",
        help="GPU prefix cache (LRU) in front of the lower tiers (default 0: none)",
    )
    parser.add_argument(
        "--disk-capacity",
        "--disk",
        action=StoreOnce,
        type=parse_tokens,
        default=0,
        metavar="TOKENS",
        help="a DISK tier behind the CPU tier, same policy (default 0: none); without "
        "--cascade it is fed independently (every block a tier lacks is offered to it, "
        "whether or not the CPU holds it)",
    )
    parser.add_argument(
        "--cascade",
        action=StoreOnce,
        choices=[m.value for m in CascadeMode],
        help="CPU -> DISK cascade (needs --disk-capacity; online policies only): stores go "
        "to the CPU tier, a lookup takes each block from CPU, else DISK. write_through: "
        "every block stored in CPU is copied to DISK at once (inclusive, capacity = max; "
        "restart-safe; one disk write per store). write_back: only blocks the CPU evicts "
        "move to DISK (exclusive, capacity = CPU + DISK; fewer disk writes; a crash loses "
        "the CPU-only blocks). Default: none, the tiers are fed independently",
    )
    parser.add_argument(
        "--block-size",
        action=StoreOnce,
        type=block_size,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per trace hash block (default {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="capacity sweep: adds lru and belady (not with --cascade), writes sweep.csv and "
        "sweep.png to --out",
    )
    parser.add_argument(
        "--out",
        action=StoreOnce,
        type=folder_output_path,
        help=f"with --sweep: folder for the sweep CSV and plot (default {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--json",
        action=StoreOnce,
        type=json_output_path,
        metavar="PATH",
        help="write every result as JSON (adds lru and belady, the reference lines; "
        "belady not with --cascade); - (or /dev/stdout) writes only the JSON to stdout, "
        "the summary and table go to stderr; default: no JSON",
    )
    parser.add_argument(
        "--release-order",
        action=StoreOnce,
        choices=[o.value for o in ReleaseOrder],
        default=ReleaseOrder.TAIL_FIRST.value,
        help="when/how a request's tier blocks are freed: tail_first (all at the end, last "
        "position first: SPEC §4, default), scheduler_tail_first (what OffloadScheduler "
        "does: loads freed before the stores allocate, then the stores, each last position "
        "first) or scheduler (the same timing in position order: the scheduler's order "
        "before it freed tail first, for comparison)",
    )
    defaults = CostModel()
    parser.add_argument(
        "--prefill-tokens-per-s",
        action=StoreOnce,
        type=rate,
        default=defaults.prefill_tokens_per_s,
        help=f"TTFT model: prefill speed in tokens/s (default {defaults.prefill_tokens_per_s:g})",
    )
    parser.add_argument(
        "--bytes-per-token",
        action=StoreOnce,
        type=bytes_per_token,
        default=defaults.bytes_per_token,
        help=f"KV bytes per token (default {defaults.bytes_per_token}: Llama-3-8B bf16)",
    )
    parser.add_argument(
        "--cpu-link-gbps",
        action=StoreOnce,
        type=rate,
        default=DEFAULT_LINK_GBPS["CPU"],
        help=f"CPU -> GPU load link in GB/s (default {DEFAULT_LINK_GBPS['CPU']:g})",
    )
    parser.add_argument(
        "--disk-link-gbps",
        action=StoreOnce,
        type=rate,
        help=f"with --disk-capacity: DISK -> GPU load link in GB/s (default "
        f"{DEFAULT_LINK_GBPS['DISK']:g})",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def add_parser(subparsers: Any) -> None:
    """Register `kvtier replay`."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a request trace through the tiers: hit ratio per policy and capacity",
        description=__doc__.splitlines()[0] + _DESCRIPTION,
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
  kvtier generate chat.jsonl     # write the multi-turn chat workload to replay
"""


def run(args: argparse.Namespace) -> int:
    """Run the replay described by parsed arguments; return the exit status.

    A reader that closes the output early (`| head`) does not stop the run: the files
    asked for are still written, and the command ends quietly with status 141, as a
    shell reports for SIGPIPE. With `--json /dev/stdout` stdout carries only the JSON
    (for `jq`), and what the command prints goes to stderr.
    """
    stdout = StdoutLines(to_stderr=_json_to_stdout(args))
    status = _run(args, stdout)
    stdout.flush()
    return EXIT_BROKEN_PIPE if stdout.reader_left else status


def _error(message: object) -> int:
    print(f"kvtier replay: error: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace, stdout: StdoutLines) -> int:
    try:
        plan = plan_replay(args)
    except (OSError, TraceError, ReplayError, ValueError) as exc:
        return _error(exc)
    records = plan.records
    summary = summarize(records, args.block_size)
    stdout.print(
        f"{args.trace}: {counted(summary.num_requests, 'request')}, "
        f"{counted(summary.num_block_refs, 'block ref')}, "
        f"{counted(summary.num_distinct_blocks, 'distinct block')}, infinite-cache token hit ratio "
        f"{summary.infinite_token_hit_ratio:.3f}"
    )
    progress = None
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        total = sweep_passes(plan.base, plan.policies, plan.capacities) * len(records)
        bar = tqdm(total=total, unit="req", leave=False, disable=progress_bar_disable())
        progress = bar.update
    try:
        with _logs_above(bar):
            points = run_sweep(
                records, plan.base, plan.policies, plan.capacities, progress, plan.keys
            )
    except ReplayError as exc:
        return _error(exc)
    finally:
        if bar is not None:
            bar.close()
    failure: OSError | None = None
    written: list[str] = []
    try:  # the files first: a reader closing stdout early must not lose them
        _write_outputs(args, plan, points, summary, written)
    except OSError as exc:  # the paths were checked before the run; a disk may still fill up
        if isinstance(exc, BrokenPipeError) and _json_to_stdout(args):
            stdout.close()  # the reader of the JSON went away: quietly, as for the table
        else:
            failure = exc
    stdout.print(format_table(points))
    stdout.print(
        f"hit: lower-tier token hit ratio; TTFT s: mean estimated TTFT "
        f"(without any cache: {points[0].result.mean_ttft_no_cache_s:.3f} s)"
    )
    for path in written:
        stdout.print(f"wrote {shell_word(path)}")
    if failure is not None:
        print(f"kvtier replay: error: writing the results failed: {failure}", file=sys.stderr)
        return 1
    return 0


def _logs_above(bar: Any) -> contextlib.AbstractContextManager[object]:
    """Print log lines (`-v`) above the progress bar, not through it."""
    if bar is None or bar.disable:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def _json_to_stdout(args: argparse.Namespace) -> bool:
    return bool(args.json) and descriptor_of(args.json) == 1


def _write_outputs(
    args: argparse.Namespace,
    plan: ReplayPlan,
    points: list[SweepPoint],
    summary: TraceSummary,
    written: list[str],
) -> None:
    """Write the sweep's CSV and plot and the JSON results asked for; add their paths to
    `written` (the JSON's as typed) as they are written.

    The files are replaced together at the end (`file_set`): an interrupted or failed
    write leaves every one of them as it was, not a mix of this run's and an older one's,
    and removes the folders `--out` made. JSON written as it goes (to a descriptor or a
    named pipe) comes after them, so a reader that leaves early costs only the JSON.
    """
    json_in_place = bool(args.json) and written_in_place(args.json)
    files: list[str] = []
    made: list[Path] = []
    try:
        if plan.out is not None:
            made = folders_to_make(plan.out)  # deepest first
            plan.out.mkdir(parents=True, exist_ok=True)
        with file_set():
            if plan.out is not None:
                title = Path(args.trace).name
                write_csv(plan.out / "sweep.csv", points)
                plot_sweep(plan.out / "sweep.png", points, title, summary.infinite_token_hit_ratio)
                files += [str(plan.out / "sweep.csv"), str(plan.out / "sweep.png")]
            if args.json and not json_in_place:
                write_json(args.json, points, args.trace, summary)
                files.append(args.json)
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):  # not empty: something else wrote there
                folder.rmdir()
        raise
    written += files
    if json_in_place:
        write_json(args.json, points, args.trace, summary)
        written.append(args.json)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kvtier replay` with `argv` (default `sys.argv[1:]`); return the exit status.

    The same path as `kvtier replay` (`kvtier.replay.command`): its handling of Ctrl-C,
    SIGTERM, a reader that went away, and the signal handlers put back on return.
    """
    from kvtier.replay.command import run_command

    return run_command(argv, ends_the_process=argv is None, parse=parse_arguments)


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse `kvtier replay`'s arguments given on their own (`python -m kvtier.replay`,
    `main`): usage errors exit with status 2, naming `kvtier replay`."""
    parser = argparse.ArgumentParser(
        prog="kvtier replay",
        description=__doc__.splitlines()[0] + _DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO level (default: WARNING)"
    )
    parser.set_defaults(command="replay")
    return parser.parse_args(attach_dashed_values(sys.argv[1:] if argv is None else argv))
