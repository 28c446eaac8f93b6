"""`kvtier demo`: a multi-turn chat on the reference engine, offload off vs on."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rich.cells import cell_len
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.cli.demo_checks import check_model_dir, check_positions, check_sizes
from kvtier.cli.demo_display import (
    logs_above_display,
    progress_console,
    results_console,
    status,
)
from kvtier.cli.demo_plot import save_ttft_plot
from kvtier.cli.demo_ranges import check_dirs, check_options
from kvtier.core.plural import counted
from kvtier.engine.chat_workload import ChatWorkload, RunResult, percentile, run_chat
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.runner import KVCacheTooLargeError
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.replay.signals import raise_if_terminated

MIB = 1 << 20
# Prompt ids stay below this (and the model's vocab): the demo model's whole vocab, and
# ordinary tokens of a real checkpoint's vocab, whose special tokens sit at the top.
PROMPT_VOCAB_SIZE = 1024


def run_demo(args: argparse.Namespace) -> int:
    """Run every configuration, print the comparison, write the plot.

    When stderr is a terminal, a transient line there says what runs: loading the
    model (a checkpoint may take a while), warming up, then each configuration served
    with a progress bar. The results go to stdout.
    Returns 0 when every configuration produced identical tokens and the plot was
    written, 1 when they differ, the plot could not be written or a run's tier could not
    be made (the verdict line and stderr say which) and 2 for a bad option (the message,
    on stderr, names it). A run whose tier served no tokens is named before the verdict
    but leaves the status as it is: its tokens are still right, and options that keep
    every history on the GPU (one conversation) or a tier too small to keep one until its
    next turn are the user's to choose.
    """
    console = results_console()
    display = progress_console()
    try:
        check_options(args)
        check_dirs(args)
        if args.model_dir is not None:
            check_model_dir(args.model_dir)
    except ValueError as exc:
        return _report(exc)
    with tempfile.TemporaryDirectory(dir=args.disk_dir, prefix="kvtier-demo-") as disk_dir:
        model: str | ModelConfig = args.model_dir or ModelConfig.demo()
        engine = EngineConfig(block_size=args.block_size, num_gpu_blocks=args.gpu_blocks)
        try:  # the status spinner is gone (stderr its own again) before the report
            with status(display, "loading the model"):
                warm = _load_engine(model, engine)
        except ValueError as exc:
            return _report(exc)
        with warm:  # the sizes, then warm up kernels and allocator (two prompts share one)
            try:
                workload, configs = _setup(args, warm.model_config.vocab_size, disk_dir)
                check_positions(workload, warm.model_config.max_position)
                check_sizes(workload, configs, warm.layout, args.gpu_blocks)
            except ValueError as exc:
                return _report(exc)
            warm_up = replace(workload, num_conversations=2, num_turns=1)
            with status(display, "warming up"):
                run_chat(warm, warm_up, "warm-up")
        del warm  # one engine's GPU pool in memory at a time
        results = []
        cannot_start = None
        shown = display.is_terminal  # elsewhere rich adds a blank line to stderr
        with (
            Progress(
                console=display, transient=True, redirect_stdout=False, disable=not shown
            ) as progress,
            logs_above_display(),
        ):
            task = progress.add_task("serving", total=len(configs) * workload.num_turns)
            for name, offload in configs:
                progress.update(task, description=f"serving: {name}")
                try:
                    llm = LLM(model, kv_offload=offload, engine=engine)
                except OSError as exc:  # the disk filled up since check_sizes
                    cannot_start = f"the {name} run cannot start: {exc}"
                    break
                with llm:

                    def on_turn() -> None:
                        progress.advance(task)
                        raise_if_terminated()  # a SIGTERM whose raise was swallowed

                    results.append(run_chat(llm, workload, name, on_turn))
                del llm  # freed before the next run builds its pool
        # Said once the bar is gone: while it shows, rich redirects stderr to its console.
        if cannot_start is not None:
            print(f"kvtier demo: error: {cannot_start}", file=sys.stderr)
            return 1
    _print_table(console, results)
    _print_transfers(console, results)
    by_turn = {r.name: _mean_ttft_ms_by_turn(r) for r in results}
    plot = save_ttft_plot(Path(args.out), by_turn)
    if plot is not None:
        console.print(f"TTFT per turn plotted to {plot}")
    baseline = results[0].output_tokens
    identical = all(r.output_tokens == baseline for r in results[1:])
    note = _untested_runs_note(results)
    if note is not None:
        console.print(note)
    console.print(
        "identical tokens across configurations: " + ("yes" if identical else "NO — a bug")
    )
    return 0 if identical and plot is not None else 1


def _report(exc: ValueError) -> int:
    """Print a bad option's message the way argparse does; return the exit status 2."""
    print(f"kvtier demo: error: {exc}", file=sys.stderr)
    return 2


def _load_engine(model: str | ModelConfig, engine: EngineConfig) -> LLM:
    """Return the warm-up engine (no offload) on `model`, a ModelConfig or --model-dir.

    A checkpoint whose weights cannot be read raises ValueError naming --model-dir; a
    GPU pool this machine's memory cannot hold, one naming --gpu-blocks and --block-size.
    """
    try:
        return LLM(model, engine=engine)
    except KVCacheTooLargeError as exc:
        raise ValueError(
            f"--gpu-blocks={counted(exc.num_blocks, 'block')} of --block-size="
            f"{counted(engine.block_size, 'token')}: {exc.detail}"
        ) from None
    except (OSError, ValueError) as exc:  # weights.load_weights: unreadable files too
        if isinstance(model, ModelConfig):
            raise
        raise ValueError(f"--model-dir={model}: {exc}") from None


def _setup(
    args: argparse.Namespace, model_vocab_size: int, disk_dir: str
) -> tuple[ChatWorkload, list[tuple[str, OffloadConfig | None]]]:
    """Return the workload and configurations (options already checked).

    Prompt token ids are drawn below `model_vocab_size` (the loaded model's) and below
    PROMPT_VOCAB_SIZE.
    """
    workload = ChatWorkload(
        num_conversations=args.conversations,
        num_turns=args.turns,
        num_system_tokens=args.system_tokens,
        num_document_tokens=args.document_tokens,
        num_user_tokens=args.user_tokens,
        num_answer_tokens=args.answer_tokens,
        vocab_size=min(model_vocab_size, PROMPT_VOCAB_SIZE),
    )
    configs: list[tuple[str, OffloadConfig | None]] = [
        ("offload off", None),
        ("CPU tier", OffloadConfig(cpu_bytes=args.cpu_mib * MIB)),
        (
            "disk tier",
            OffloadConfig(
                disk_bytes=args.disk_mib * MIB,
                disk_path=disk_dir,
                disk_io_mode=DiskIOMode(args.disk_io),
            ),
        ),
        (
            "CPU+disk",
            OffloadConfig(
                cpu_bytes=args.cascade_cpu_mib * MIB,
                disk_bytes=args.disk_mib * MIB,
                disk_path=disk_dir,
                disk_io_mode=DiskIOMode(args.disk_io),
                cascade=CascadeMode(args.cascade),
            ),
        ),
    ]
    return workload, configs


def _print_table(console: Console, results: list[RunResult]) -> None:
    table = Table(title="multi-turn chat on the reference engine (TTFT: time to first token)")
    headers = (
        "config",
        "TTFT p50",
        "TTFT p90",
        "p50 off-GPU",
        "tok/s",
        "GPU hits",
        "tier hits",
        "MiB in",
        "MiB out",
    )
    rows = []
    base = percentile(results[0].ttfts(history_left_gpu=True), 0.5)
    for r in results:
        off_gpu_ttfts = r.ttfts(history_left_gpu=True)
        off_gpu = percentile(off_gpu_ttfts, 0.5)
        ratio = f" ({off_gpu / base:.2f}x)" if base else ""
        rows.append(
            (
                r.name,
                f"{percentile(r.ttfts(), 0.5) * 1e3:.0f} ms",
                f"{percentile(r.ttfts(), 0.9) * 1e3:.0f} ms",
                f"{off_gpu * 1e3:.0f} ms{ratio}" if off_gpu_ttfts else "- (none left the GPU)",
                f"{r.tokens_per_s:.0f}",
                str(sum(t.num_local_hit_tokens for t in r.turns)),
                _tier_hits(r),
                f"{r.num_bytes_loaded / MIB:.1f}",
                f"{r.num_bytes_stored / MIB:.1f}",
            )
        )
    _fill_table(table, console.width, headers, rows)
    console.print(table)


def _fill_table(
    table: Table, console_width: int, headers: Sequence[str], rows: Sequence[Sequence[str]]
) -> None:
    """Add right-aligned columns and `rows` to `table` (default box and padding), each
    column narrowed to fit `console_width` but never below its longest word.

    Rich narrows a table too wide for the terminal without regard to words: in an
    80-column terminal it cut the demo's cells to a few characters and an ellipsis
    ("143…", "…" for tok/s). Here a cell wraps at its spaces instead ("156 ms" over
    "(1.00x)"); a terminal narrower than the longest words folds them, losing nothing.
    """
    cells = [list(headers), *map(list, rows)]
    columns = range(len(headers))
    widths = [max(cell_len(row[i]) for row in cells) for i in columns]
    least = [
        max((cell_len(word) for row in cells for word in row[i].split()), default=0)
        for i in columns
    ]
    budget = console_width - 3 * len(headers) - 1  # a border and two spaces per column
    while sum(widths) > budget:
        narrowable = [i for i in columns if widths[i] > least[i]]
        if not narrowable:
            break
        widths[max(narrowable, key=lambda i: widths[i])] -= 1
    for header, width in zip(headers, widths, strict=True):
        table.add_column(header, justify="right", width=width, overflow="fold")
    for row in rows:
        table.add_row(*row)


# Why the directions' rates differ although each is the same kind of copy (measured:
# one job of N blocks costs the same either way; a job's fixed cost is ~0.1-0.5 ms).
TRANSFERS_CAPTION = (
    "copy time: each job timed on its transfer thread, queueing excluded. Stores go in small "
    "jobs (a few blocks per step) beside the forward pass, loads in one job per request "
    "while the engine waits: the fixed cost per job and the shared cores make stores look "
    "slower."
)
_DIRECTIONS = ("GPU_to_CPU", "CPU_to_GPU", "GPU_to_DISK", "DISK_to_GPU", "CPU_to_DISK")


def _print_transfers(console: Console, results: list[RunResult]) -> None:
    """Print each configuration's bytes moved and achieved bandwidth per direction."""
    seen = {kind for r in results for kind in r.transfer_bytes}
    directions = [kind for kind in _DIRECTIONS if kind in seen] + sorted(seen - set(_DIRECTIONS))
    if not directions:
        return
    table = Table(
        title="copies per direction: MiB moved, achieved bandwidth (copy time)",
        caption=TRANSFERS_CAPTION,
        caption_justify="left",
    )
    headers = ["config", *(kind.replace("_to_", " → ") for kind in directions)]
    rows = []
    for r in results[1:]:
        cells = [r.name]
        for kind in directions:
            num_bytes, seconds = r.transfer_bytes.get(kind, 0), r.transfer_seconds.get(kind, 0.0)
            rate = f" at {num_bytes / seconds / MIB:.0f} MiB/s" if num_bytes and seconds else ""
            cells.append(f"{num_bytes / MIB:.1f}{rate}" if num_bytes else "-")
        rows.append(cells)
    _fill_table(table, console.width, headers, rows)
    console.print(table)


def _untested_runs_note(results: list[RunResult]) -> str | None:
    """Name the offload runs whose tiers served no tokens, or return None.

    Such a run computed every token as offload off did, so its identical tokens test no
    tier: a workload whose histories stay on the GPU said "identical: yes" all the same.
    """
    names = [r.name for r in results[1:] if not any(t.num_external_hit_tokens for t in r.turns)]
    if not names:
        return None
    runs = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    s, its = ("s", "their") if len(names) > 1 else ("", "its")
    return (
        f"the {runs} run{s} served no tokens from {its} tier{s}: {its} tokens were computed"
        " as with offload off, so comparing them tests no tier; use more --conversations or"
        " fewer --gpu-blocks, so that histories leave the GPU"
    )


def _tier_hits(result: RunResult) -> str:
    """Return the tier hit tokens, per tier when several tiers served them."""
    total = sum(t.num_external_hit_tokens for t in result.turns)
    by_tier = result.hit_tokens_by_tier
    if len(by_tier) < 2:
        return str(total)
    return f"{total} (" + ", ".join(f"{tier} {n}" for tier, n in by_tier.items()) + ")"


def _mean_ttft_ms_by_turn(result: RunResult) -> dict[int, float]:
    """Return {turn: mean TTFT in ms over the conversations}."""
    ttfts: dict[int, list[float]] = {}
    for t in result.turns:
        ttfts.setdefault(t.turn, []).append(t.ttft_s)
    return {turn: sum(values) / len(values) * 1e3 for turn, values in sorted(ttfts.items())}
