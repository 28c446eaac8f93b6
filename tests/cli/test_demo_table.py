"""`kvtier demo`'s tables: the off-GPU column shows a time only where some turn's history
left the GPU (it showed a made-up 0 ms when none did); in an 80-column terminal cells wrap
at their spaces instead of being cut to an ellipsis."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table

from kvtier.cli.demo import _fill_table, _mean_ttft_ms_by_turn, _print_table, _print_transfers
from kvtier.engine.chat_workload import RunResult, TurnResult


def turn(turn: int, ttft_s: float, local_hit: int) -> TurnResult:
    return TurnResult(0, turn, 64, ttft_s, (1,), local_hit, 0)


def table_text(results: list[RunResult], width: int = 200) -> str:
    out = io.StringIO()
    _print_table(Console(file=out, width=width), results)
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


def served(name: str, ttft_s: float, loaded_mib: int) -> RunResult:
    """A run with every cell of the table filled: off-GPU turns, tier hits of two tiers,
    and bytes copied in every direction."""
    turns = (turn(0, ttft_s, 0), TurnResult(0, 1, 64, ttft_s / 3, (1,), 0, 2880))
    return RunResult(
        name,
        turns,
        1.0,
        loaded_mib << 20,
        loaded_mib << 20,
        {"CPU": 2880, "DISK": 1234},
        {"GPU_to_CPU": 13 << 20, "CPU_to_GPU": 17 << 20, "GPU_to_DISK": 13 << 20},
        {"GPU_to_CPU": 0.011, "CPU_to_GPU": 0.007, "GPU_to_DISK": 0.037},
    )


def test_an_80_column_terminal_wraps_cells_instead_of_cutting_them() -> None:
    # Regression: rich narrowed both tables to 80 columns by cutting every cell
    # ("143…", "offloa…", "…" for tok/s and the MiB columns, "12.8 at 112…").
    results = [served("offload off", 1.143, 0), served("CPU+disk", 0.07, 17)]
    out = io.StringIO()
    console = Console(file=out, width=80)
    _print_table(console, results)
    _print_transfers(console, results)
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    words = set(text.replace("│", " ").split())
    for word in ("offload", "CPU+disk", "762", "1067", "(0.06x)", "(CPU", "DISK", "1234)"):
        assert word in words
    for word in ("130", "17.0", "1182", "2429", "MiB/s"):  # tok/s, MiB in, bandwidths
        assert word in words


def test_a_wide_terminal_keeps_one_line_per_configuration() -> None:
    text = table_text([served("offload off", 1.143, 0), served("CPU+disk", 0.07, 17)])
    (line,) = [line for line in text.splitlines() if "offload off" in line]
    for cell in ("762 ms", "1067 ms", "381 ms (1.00x)", "2880 (CPU 2880, DISK 1234)"):
        assert f" {cell} │" in line


def cells_of(text: str, name: str) -> list[str]:
    """Return the cells of the row of configuration `name` (one line: a wide console)."""
    (line,) = [line for line in text.splitlines() if f" {name} │" in line]
    return [cell.strip() for cell in line.split("│")[1:-1]]


def test_each_count_goes_to_its_own_column() -> None:
    """Found by a mutation run (s29): tier hits in the GPU hits column, or MiB in and
    MiB out swapped, passed every test: the tests' runs had equal values there."""
    turns = (turn(0, 0.5, 48), TurnResult(0, 1, 96, 0.2, (1,), 16, 80))
    off = RunResult("offload off", (turn(0, 0.5, 48), turn(1, 0.2, 16)), 1.0, 0, 0)
    cpu = RunResult("CPU tier", turns, 1.0, 17 << 20, 13 << 20, {"CPU": 80})
    cells = cells_of(table_text([off, cpu]), "CPU tier")
    assert cells[5:] == ["64", "80", "17.0", "13.0"]  # GPU hits, tier hits, MiB in, MiB out


def test_the_copies_table_has_a_row_per_offload_run_and_no_rate_without_a_time() -> None:
    """Found by a mutation run (s29): a row for offload off (nothing but dashes), a
    ZeroDivisionError for a copy timed at 0 s, and a direction left out because the
    table did not know it all passed every test."""
    moved = {"GPU_to_CPU": 3 << 20, "CPU_to_GPU": 2 << 20, "DISK_to_CPU": 1 << 20}
    timed = {"GPU_to_CPU": 0.0, "CPU_to_GPU": 0.004, "DISK_to_CPU": 0.002}
    off = RunResult("offload off", (turn(0, 0.5, 0),), 1.0, 0, 0)
    cpu = RunResult("CPU tier", (turn(0, 0.5, 0),), 1.0, 0, 0, {}, moved, timed)
    out = io.StringIO()
    _print_transfers(Console(file=out, width=200), [off, cpu])
    text = out.getvalue()
    assert "offload off" not in text
    assert cells_of(text, "CPU tier") == ["CPU tier", "3.0", "2.0 at 500 MiB/s", "1.0 at 500 MiB/s"]
    assert "DISK → CPU ┃" in text  # its header, last


def test_no_copies_table_when_nothing_was_copied() -> None:
    run = RunResult("CPU tier", (turn(0, 0.5, 0),), 1.0, 0, 0)
    out = io.StringIO()
    _print_transfers(Console(file=out, width=200), [run, run])
    assert out.getvalue() == ""


def test_the_plot_gets_each_turn_s_mean_ttft_over_the_conversations_in_ms() -> None:
    """Found by a mutation run (s29): the plotted values summed the conversations, or were
    keyed by conversation, with every test passing (none looked at the plot's data)."""
    turns = (
        TurnResult(0, 0, 64, 0.5, (1,), 0, 0),
        TurnResult(1, 0, 64, 0.3, (1,), 0, 0),
        TurnResult(2, 0, 64, 0.4, (1,), 0, 0),
        TurnResult(0, 1, 96, 0.1, (1,), 0, 0),
        TurnResult(1, 1, 96, 0.2, (1,), 0, 0),
        TurnResult(2, 1, 96, 0.3, (1,), 0, 0),
    )
    by_turn = _mean_ttft_ms_by_turn(RunResult("CPU tier", turns, 1.0, 0, 0))
    assert by_turn == pytest.approx({0: 400.0, 1: 200.0})


def test_a_table_one_column_too_wide_narrows_its_widest_column() -> None:
    """Found by a mutation run (s29): narrowing the narrowest column first (wrapping the
    config names before the long time cells) passed every test."""
    table = Table()
    # widths 8 and 14 in a budget of 28 - 3 x 2 - 1 = 21: one column loses one cell
    _fill_table(table, 28, ["config", "TTFT"], [["CPU tier", "156 ms (1.00x)"]])
    assert [column.width for column in table.columns] == [8, 13]
