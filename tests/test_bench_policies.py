"""`benchmarks/bench_policies.py` (the cost table of docs/policies.md): a --quick run
prints a row per policy and capacity, the summary line and JSON with every number; its
memory reading counts what a tier owns. No timing is asserted."""

from __future__ import annotations

import gc
import importlib
import json
import re
import tracemalloc
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
POLICIES = ["lru", "arc", "s3fifo", "lfuda", "duel", "lru+door"]


def script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


class CountingBar:
    """Stands in for tqdm: keeps each bar's total and count."""

    bars: ClassVar[list[CountingBar]] = []

    def __init__(self, total: int | None, **_: Any) -> None:
        self.total = total
        self.n = 0
        CountingBar.bars.append(self)

    def __enter__(self) -> CountingBar:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self.n += n


def test_a_quick_run_prints_every_policy_at_both_capacities(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = script("bench_policies", monkeypatch)
    monkeypatch.setattr(script("progress_bar", monkeypatch), "TerminalBar", CountingBar)
    monkeypatch.setattr(CountingBar, "bars", [])
    out = tmp_path / "policies.json"
    argv = ["--quick", "--capacity", "200", "--requests", "30", "--reps", "2", "--json", out]
    bench.main([str(a) for a in argv])
    lines = capsys.readouterr().out.splitlines()

    assert lines[0].startswith("bench_policies: ")
    assert "capacities 200 and 2k blocks" in lines[0]
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in POLICIES]
    assert [(r[0], r[1]) for r in rows] == [(p, c) for c in ("200", "2k") for p in POLICIES]
    assert lines[-1].startswith("bench_policies: µs per block reference x lru at 2k blocks: ")
    pattern = (
        r"arc [\d.]+x, s3fifo [\d.]+x, lfuda [\d.]+x, duel [\d.]+x, lru\+door [\d.]+x; "
        r"O\(1\) 2k/200 max [\d.]+x \(\S+; lru [\d.]+x\); bytes/block lru \d+, arc [+-]\d+, "
        r"s3fifo [+-]\d+, lfuda [+-]\d+, duel [+-]\d+, lru\+door [+-]\d+$"
    )
    assert re.search(pattern, lines[-1]), lines[-1]

    record = json.loads(out.read_text())
    assert record["summary_line"] == lines[-1]
    assert set(record["summary"]["us_per_ref_x_lru"]) == set(POLICIES) - {"lru"}
    for row in record["rows"]:
        for name in ("us_per_ref", "us_per_hit", "us_per_offer", "us_per_store"):
            assert len(row[name]["reps"]) == 2
            assert 0 < row[name]["min"] <= row[name]["median"] <= row[name]["max"]
        if row["policy"] == "lru":
            assert row["us_per_ref"]["x_lru"] == 1.0
        if row["capacity_blocks"] == 200:
            assert row["us_per_ref"]["x_small"] == 1.0
        # Filled tiers: every slot holds a key, so every store evicts one.
        assert row["evictions_per_store"]["median"] == 1.0
        refused = row["refused_per_offer"]["median"]
        assert refused > 0.3 if row["policy"] == "lru+door" else refused == 0.0
        assert 0.05 < row["hit_ratio"]["median"] < 0.5
    by = {(r["policy"], r["capacity_blocks"]): r for r in record["rows"]}
    for policy in POLICIES[1:]:  # every other policy keeps state beside the pool's
        assert by[(policy, 2000)]["extra_bytes_per_block_vs_lru"] > 0, policy

    fill, timing = CountingBar.bars
    assert fill.n == fill.total == 2 * (200 + 2000) * len(POLICIES)
    assert timing.n == timing.total == (2 + 1) * 2 * len(POLICIES)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_owned_bytes_agrees_with_tracemalloc(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory column sums `sys.getsizeof` over what a tier reaches; tracemalloc sees
    every allocation made while it was built and filled: within 10 %, keys included."""
    workload = script("policy_workload", monkeypatch)
    gc.collect()
    tracemalloc.start()
    try:
        item = workload.PolicyTier.build(policy, 5000, 8, 0.5, 0)
        item.fill(10_000, 64, lambda n: None)
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    owned = workload.owned_bytes(item.tier)
    assert 0.9 * traced < owned <= traced
    assert owned / 5000 > 100  # a pool slot and its 36-byte key object are counted


def table_row(policy: str, us_min: float, us_max: float) -> dict[str, Any]:
    """A row as `collect` returns it, with the numbers the table prints."""
    times = {"median": 2.5, "min": us_min, "max": us_max, "x_lru": 1.25, "x_small": 1.0}
    row: dict[str, Any] = {"policy": policy, "capacity_blocks": 20_000}
    row |= dict.fromkeys(("us_per_ref", "us_per_hit", "us_per_offer", "us_per_store"), times)
    row |= {name: {"median": 0.5} for name in ("evictions_per_store", "refused_per_offer")}
    row |= {"hit_ratio": {"median": 0.25}, "bytes_per_block": 188.0}
    return row | {"extra_bytes_per_block_vs_lru": 40.0}


def test_table_columns_fit_their_widest_cell(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a `(min-max)` wider than 13 characters ran into the µs/ref median
    beside it ("2.50(123.45-1234.56)")."""
    bench = script("bench_policies", monkeypatch)
    bench.print_table([table_row("lru", 1.5, 3.5), table_row("lru+door", 123.45, 1234.56)])
    header, *lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == [
        "lru+door", "20k", "2.50", "(123.45-1234.56)", "1.25", "1.00", "2.50", "1.25", "2.50",
        "1.25", "2.50", "0.50", "0.50", "0.25", "188", "+40",
    ]  # fmt: skip
    for column in ("(min-max)", "B/block", "vs lru"):  # right-aligned under the header
        end = header.index(column) + len(column)
        assert all(line[end - 1] != " " and line[end : end + 1] in ("", " ") for line in lines)


def test_the_clock_read_cost_ignores_batches_the_os_slowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine preempts some of the calibration batches; the cost subtracted per
    timed interval is the fast batches', or short intervals come out below zero."""
    bench = script("bench_policies", monkeypatch)
    now, calls, reads = [0], [0], 100

    def clock() -> int:  # batches 1-3 of 5 are slowed 100-fold
        now[0] += 5_000 if 1 <= calls[0] // reads <= 3 else 50
        calls[0] += 1
        return now[0]

    monkeypatch.setattr(bench.time, "perf_counter_ns", lambda: now[0])
    assert bench.clock_read_ns(clock, reads) == 50
