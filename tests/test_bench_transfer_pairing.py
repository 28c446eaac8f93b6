"""`benchmarks/bench_transfer.py` times each transfer between two copies of its baseline
(same direction) and divides their mean by it, so a machine whose speed drifts during a
repetition (other processes taking cores or memory bandwidth) leaves the ratio unbiased.

Regression: each repetition timed the down and up copies once, then the four patterns, so
a pattern's time was divided by a copy timed up to five operations earlier; a machine
slowing by 10% per operation turned a true 0.8x into 0.55-0.66x.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SLOWDOWN_PER_OP = 1.1  # each operation takes 10% longer than the one before
TRANSFER_COST = 1.25  # a transfer takes 1.25 copies: its true ratio is 0.8


def script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


class DriftingCase:
    """Stands in for `bench_transfer.Case` on a machine that slows down steadily: records
    each operation and the time it would take."""

    def __init__(self, *_: Any) -> None:
        self.ops: list[str] = []
        self.seconds: list[float] = []  # each operation's, in `ops`' order
        self.speed = 1.0
        self.last_s = 0.0
        self.worker = self

    def shutdown(self) -> None:
        pass

    def _op(self, name: str, cost: float) -> None:
        self.ops.append(name)
        self.last_s = cost * self.speed
        self.seconds.append(self.last_s)
        self.speed *= SLOWDOWN_PER_OP

    def copy_down(self) -> None:
        self._op("down", 1.0)

    def copy_up(self) -> None:
        self._op("up", 1.0)

    def transfer(self, pattern: str) -> None:
        self._op(pattern, TRANSFER_COST)


def drifting_bench(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, list[DriftingCase]]:
    bench_transfer = script("bench_transfer", monkeypatch)
    cases: list[DriftingCase] = []

    def new_case(*args: Any) -> DriftingCase:
        cases.append(DriftingCase(*args))
        return cases[-1]

    def timed(fn: Any) -> float:
        fn()
        return cases[-1].last_s

    monkeypatch.setattr(bench_transfer, "Case", new_case)
    monkeypatch.setattr(bench_transfer, "timed", timed)
    return bench_transfer, cases


def test_each_transfer_is_timed_between_two_copies_of_its_direction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench_transfer, cases = drifting_bench(monkeypatch)
    args = argparse.Namespace(
        total_mib=1, reps=3, device="cpu", copy_threads=None, baseline_pairs=None
    )
    bench_transfer.run_config(64, 1, args)
    ops = cases[0].ops
    warm_up = ["down", "up", *bench_transfer.PATTERNS]
    assert ops[: len(warm_up)] == warm_up
    timed_ops = ops[len(warm_up) :]
    assert timed_ops.count("store") == 3
    for i, op in enumerate(timed_ops):
        if op in bench_transfer.PATTERNS:
            expected = "down" if "store" in op else "up"
            assert timed_ops[i - 1] == timed_ops[i + 1] == expected, (i, timed_ops)


def test_a_steadily_slowing_machine_leaves_the_ratios_unbiased(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench_transfer, _ = drifting_bench(monkeypatch)
    args = argparse.Namespace(
        total_mib=1, reps=5, device="cpu", copy_threads=None, baseline_pairs=None
    )
    row = bench_transfer.run_config(64, 1, args)
    for pattern in bench_transfer.PATTERNS:  # (1 + 1.21) / 2 / (1.25 * 1.1) = 0.804
        assert row.ratio[pattern] == pytest.approx(1 / TRANSFER_COST, rel=0.01), row.ratio
        low, high = row.ratio_spread[pattern]
        assert high - low < 1e-9  # the same bias-free ratio in every repetition


def test_copy_gbs_is_from_the_median_of_every_copy_counted_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: "copy GB/s" came from the median of the per-transfer baselines, the
    means of the copies on either side, so the middle copy of each `copy, store, copy,
    frag store, copy` group counted twice and the end ones once."""
    bench_transfer, cases = drifting_bench(monkeypatch)
    args = argparse.Namespace(
        total_mib=1, reps=4, device="cpu", copy_threads=None, baseline_pairs=None
    )
    row = bench_transfer.run_config(64, 1, args)
    num_warm_up = 2 + len(bench_transfer.PATTERNS)  # a copy each way, then each pattern
    timed_ops = zip(cases[0].ops[num_warm_up:], cases[0].seconds[num_warm_up:], strict=True)
    copies = [seconds for op, seconds in timed_ops if op in ("down", "up")]
    assert len(copies) == 4 * 2 * 3  # reps x directions x copies per group
    expected = row.mib * 2**20 / statistics.median(copies) / 1e9
    assert row.copy_gbs == pytest.approx(expected, rel=1e-12)


def test_the_baseline_copies_take_turns_over_as_much_memory_as_the_worker_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Regression: every baseline copy reused one buffer pair, which a machine with a large
    # last-level cache (a 480 MiB L3) kept in cache, while the transfers' memory (engine
    # regions + host tier, twice the pair's bytes) was not: the baseline copied from cache.
    bench_transfer = script("bench_transfer", monkeypatch)
    block_bytes, regions, num = 4096, 2, 8
    case = bench_transfer.Case(block_bytes, regions, num, "cpu", 1)
    try:
        nbytes = num * block_bytes * regions
        worker_bytes = sum(t.numel() for t in case.kv) + sum(
            t.numel() for t in case.worker.host_tier.views
        )
        used = []
        for copy in (case.copy_down, case.copy_up, case.copy_down, case.copy_up):
            copy()
            used.append(case._turn)
        buffers = {t.data_ptr() for pair in case.pairs for t in pair}
        assert all(t.numel() == nbytes for pair in case.pairs for t in pair)
        assert len(buffers) * nbytes >= worker_bytes - regions * block_bytes  # its spare block
        assert len(case.pairs) == 2
        assert used == [1, 2, 3, 4]
        single = bench_transfer.Case(block_bytes, regions, num, "cpu", 1, baseline_pairs=1)
        assert len(single.pairs) == 1
        single.worker.shutdown()
    finally:
        case.worker.shutdown()
