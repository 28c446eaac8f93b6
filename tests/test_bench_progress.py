"""The replay benchmarks' progress bar: one bar over the work of every worker process.

Regression: `bench_replay.py` (about 2.5 minutes) and `bench_cascade.py` (about 1 minute)
printed nothing between their first line and their results.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


class RecordingBar:
    """Stands in for tqdm in the parent process: keeps its total and count."""

    bars: ClassVar[list[RecordingBar]] = []

    def __init__(self, total: int, **_: Any) -> None:
        self.total = total
        self.n = 0
        self.totals_seen: list[int] = []
        RecordingBar.bars.append(self)

    def __enter__(self) -> RecordingBar:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def refresh(self) -> None:
        self.totals_seen.append(self.total)

    def update(self, n: int) -> None:
        self.n += n
        assert self.n <= self.total, "more work done than announced"


class RecordingProgress:
    """Stands in for a worker's `Progress` when a workload runs in this process."""

    def __init__(self) -> None:
        self.total = 0
        self.done = 0

    def add_total(self, n: int) -> None:
        self.total += n

    def advance(self, n: int) -> None:
        self.done += n


def work(units: int, step: int, progress: Any) -> str:
    """A worker: announces `units`, then does them `step` at a time."""
    progress.add_total(units)
    for _ in range(units // step):
        progress.advance(step)
    progress.advance(units % step)
    return f"did {units}"


def test_the_bar_adds_up_every_workers_total_and_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool_progress = script("pool_progress", monkeypatch)
    monkeypatch.setattr(pool_progress, "tqdm", RecordingBar)
    RecordingBar.bars.clear()
    calls = [(work, (1000, 7)), (work, (10, 3)), (work, (0, 1)), (work, (555, 100))]
    results = pool_progress.run_with_progress(2, calls, unit="req")
    assert results == ["did 1000", "did 10", "did 0", "did 555"]  # in call order
    (bar,) = RecordingBar.bars
    assert bar.total == bar.n == 1565
    assert bar.totals_seen[-1:] == [1565]


def boom(progress: Any) -> None:
    progress.add_total(5)
    raise ValueError("a worker failed")


def test_a_workers_error_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    pool_progress = script("pool_progress", monkeypatch)
    monkeypatch.setattr(pool_progress, "tqdm", RecordingBar)
    with pytest.raises(ValueError, match="a worker failed"):
        pool_progress.run_with_progress(2, [(work, (10, 1)), (boom, ())], unit="req")


def test_bench_cascade_announces_every_request_it_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench_cascade = script("bench_cascade", monkeypatch)
    progress = RecordingProgress()
    rows = bench_cascade.run_workload("chat", bench_cascade.MOONCAKE, "lru", 60, progress)
    runs = len(bench_cascade.TOTALS) * len(bench_cascade.SETUPS)
    assert len(rows) == runs
    assert progress.total == progress.done == runs * 60


def test_bench_replay_announces_every_pass_of_its_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bench_replay = script("bench_replay", monkeypatch)
    load = bench_replay.load_workload
    monkeypatch.setattr(bench_replay, "load_workload", lambda *a: load(*a)[:40])
    progress = RecordingProgress()
    capacities = [100_000, 1_000_000]
    result = bench_replay.run_workload(
        "chat", bench_replay.MOONCAKE, capacities, tmp_path, progress
    )
    assert result["csv"] == str(tmp_path / "chat.csv")
    assert progress.total == progress.done > 40 * len(capacities)
