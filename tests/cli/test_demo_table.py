"""`kvtier demo`'s table: the off-GPU column shows a time only where some turn's history
left the GPU (it showed a made-up 0 ms when none did)."""

from __future__ import annotations

import io

from rich.console import Console

from kvtier.cli.demo import _print_table
from kvtier.engine.chat_workload import RunResult, TurnResult


def turn(turn: int, ttft_s: float, local_hit: int) -> TurnResult:
    return TurnResult(0, turn, 64, ttft_s, (1,), local_hit, 0)


def table_text(results: list[RunResult]) -> str:
    out = io.StringIO()
    _print_table(Console(file=out, width=200), results)
    return out.getvalue()


def test_the_off_gpu_column_is_a_dash_when_no_history_left_the_gpu() -> None:
    on_gpu = (turn(0, 0.5, 0), turn(1, 0.2, 64))  # turn 1 found its history on the GPU
    text = table_text([RunResult("offload off", on_gpu, 1.0, 0, 0)])
    assert "- (none left the GPU)" in text
    assert " 0 ms" not in text


def test_the_off_gpu_column_compares_each_config_with_the_first() -> None:
    off = RunResult("offload off", (turn(0, 0.5, 0), turn(1, 0.4, 0)), 1.0, 0, 0)
    cpu = RunResult("CPU tier", (turn(0, 0.5, 0), turn(1, 0.1, 0)), 1.0, 0, 0)
    text = table_text([off, cpu])
    assert "400 ms (1.00x)" in text
    assert "100 ms (0.25x)" in text
