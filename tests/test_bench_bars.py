"""The in-process benchmarks' progress bars (`benchmarks/progress_bar.py`): each counts
exactly the work its benchmark does, and moves outside the benchmark's timers.

Regression: `bench_pool.py` (about 90 s on 2 cores, 61 s of it building and churning
the 10M pool without a line), `bench_scheduler.py` (about 35 s) and `bench_engine.py`
(about 3.5 minutes, 150 s before its first run's line) printed nothing while they worked.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import pytest

from kvtier.engine.config import ModelConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


class RecordingBar:
    """Stands in for tqdm: keeps each bar's total, count and names; each update moves
    `clock_ns` on by `pause_s`, so that an update inside a timer shows in the numbers of
    a benchmark timed by that clock (`bar_clock`)."""

    bars: ClassVar[list[RecordingBar]] = []
    pause_s: ClassVar[float] = 0.0
    now_ns: ClassVar[int] = 0

    @staticmethod
    def clock_ns() -> int:
        """A clock that moves 1 ns per read and `pause_s` per update, nothing else: the
        benchmarks' timers read it, not the wall clock, so what they measure is the same
        on a loaded machine (one preempted rep took 46 µs/op; a 3k pool's build, 58 ms)."""
        RecordingBar.now_ns += 1
        return RecordingBar.now_ns

    @staticmethod
    def clock_s() -> float:
        return RecordingBar.clock_ns() / 1e9

    def __init__(self, total: int | None, desc: str | None = None, **_: Any) -> None:
        self.total = total
        self.n = 0
        self.descs = [desc]
        self.closed = False
        RecordingBar.bars.append(self)

    def __enter__(self) -> RecordingBar:
        return self

    def __exit__(self, *_: object) -> None:
        self.closed = True

    def set_description(self, desc: str) -> None:
        self.descs.append(desc)

    def update(self, n: int = 1) -> None:
        assert not self.closed, "an update after the bar closed"
        self.n += n
        assert self.total is None or self.n <= self.total, "more work done than announced"
        RecordingBar.now_ns += round(self.pause_s * 1e9)


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[RecordingBar]:
    """Record every bar the benchmarks draw (through `progress_bar`)."""
    progress_bar = script("progress_bar", monkeypatch)
    monkeypatch.setattr(progress_bar, "TerminalBar", RecordingBar)
    monkeypatch.setattr(RecordingBar, "bars", [])
    monkeypatch.setattr(RecordingBar, "now_ns", 0)
    return RecordingBar.bars


def bar_clock(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Time `module`'s wall clock runs (`CLOCKS["wall"]`) by `RecordingBar.clock_ns`."""
    monkeypatch.setitem(module.CLOCKS, "wall", RecordingBar.clock_ns)


def test_bench_scheduler_counts_every_round_of_steps_outside_the_step_timers(
    bars: list[RecordingBar], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bench_scheduler = script("bench_scheduler", monkeypatch)
    bar_clock(bench_scheduler, monkeypatch)
    monkeypatch.setattr(RecordingBar, "pause_s", 0.01)
    out = tmp_path / "scheduler.json"
    argv = ["--sizes", "8,16", "--warmup", "5", "--steps", "2", "--reps", "2", "--json", out]
    monkeypatch.setattr(sys, "argv", ["bench_scheduler.py", *map(str, argv)])
    bench_scheduler.main()
    results = json.loads(out.read_text())["results"]
    rounds = sum(5 + r["num_windows"] * r["num_steps_per_window"] for r in results)
    (bar,) = bars
    assert bar.total == bar.n == rounds == 5 + 2 * 64 + 5 + 2 * 32
    assert bar.descs == [None, "8 running", "16 running"]
    for r in results:  # a 10 ms update inside a step would show in every window
        for mode in r["modes"].values():
            assert mode["engine_us"]["max"] < 5000, mode["engine_us"]


def test_bench_pool_counts_blocks_built_and_churned_and_reps_outside_the_timers(
    bars: list[RecordingBar], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench_pool = script("bench_pool", monkeypatch)
    bar_clock(bench_pool, monkeypatch)
    pool_build = script("pool_build", monkeypatch)  # times a build by `time.perf_counter`
    monkeypatch.setattr(pool_build, "time", SimpleNamespace(perf_counter=RecordingBar.clock_s))
    monkeypatch.setattr(RecordingBar, "pause_s", 0.1)
    args = argparse.Namespace(seed=0, ops=200, reps=2, clock="wall")
    results = bench_pool.run([1000, 3000], args)
    names = [bar.descs[0] for bar in bars]
    assert names == ["build 1k", "churn 1k", "build 3k", "churn 3k", "time"]
    build_1k, churn_1k, build_3k, churn_3k, timing = bars
    assert build_1k.total == build_1k.n == 2 * 999  # each block cached, then freed
    assert build_3k.total == build_3k.n == 2 * 2999
    assert churn_1k.n == results[0]["num_churned_blocks"] > 0
    assert churn_3k.n == results[1]["num_churned_blocks"] > 0
    assert timing.total == timing.n == (2 + 1) * 2  # a warm-up rep, then 2, of each size
    for result in results:  # one 100 ms update inside the build would show
        assert result["build_s"] < 0.05, result["build_s"]
        for op, numbers in result["ns_per_op"].items():  # inside a rep: 500 µs/op
            assert numbers["max"] < 50_000, (op, numbers)


def test_bench_engine_counts_each_runs_requests(
    bars: list[RecordingBar], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bench_engine = script("bench_engine", monkeypatch)
    monkeypatch.setattr(bench_engine.ModelConfig, "demo", staticmethod(ModelConfig.tiny))
    out = tmp_path / "engine.json"
    argv = ["--reps", "2", "--conversations", "3", "--turns", "2", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", *argv])
    bench_engine.main()
    runs = json.loads(out.read_text())["runs"]
    assert [bar.descs for bar in bars] == [
        ["warm-up: off"],
        ["warm-up: cpu"],
        ["rep 0: off"],
        ["rep 0: cpu"],
        ["rep 1: cpu"],
        ["rep 1: off"],
    ]
    for bar in bars[:2]:  # the default 2 warm-up conversations
        assert bar.total == bar.n == 2 * 2
    for bar in bars[2:]:
        assert bar.total == bar.n == 3 * 2
    assert len(runs["off"]["tokens_per_s"]) == len(runs["cpu"]["tokens_per_s"]) == 2


def test_a_drawn_bar_starts_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: tqdm's monitor thread, started with the first bar drawn, raised
    bench_pool's resident memory of a 10M-block pool from 169.6 to 173.4 bytes per block."""
    progress_bar = script("progress_bar", monkeypatch)
    monkeypatch.setattr(progress_bar, "progress_bar_disable", lambda: False)  # as on a terminal
    threads = threading.active_count()
    with progress_bar.progress_bar(3, unit="step", desc="work") as bar:
        assert not bar.disable
        for _ in range(3):
            bar.update(1)
            assert threading.active_count() == threads
    assert bar.n == 3
