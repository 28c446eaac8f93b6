"""`kvtier replay`'s text output: exact capacity labels, a table whose columns never touch,
and a sweep plot that shows every policy even at a single capacity."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay.cli import main, parse_tokens
from kvtier.replay.config import ReplayConfig, TierConfig
from kvtier.replay.report import format_table, format_tokens
from kvtier.replay.sweep import SweepPoint, run_sweep, sweep_figure
from kvtier.replay.trace import write_trace

NUM_COLUMNS = 11  # policy ... TTFT s, then the per-tier hit ratios (one cell)


@pytest.mark.parametrize(
    ("num_tokens", "label"),
    [
        (512, "512"),
        (2048, "2048"),
        (300_000, "300k"),
        (999_990, "999.99k"),
        (1_000_000, "1M"),
        (1_000_001, "1000001"),
        (1_000_010, "1000010"),
        (1_500_000, "1.5M"),
        (10**10, "10G"),
        (1_500_000_000, "1.5G"),
        (999_999_999 * 10**9, "999999999G"),
    ],
)
def test_capacity_labels_are_exact_and_read_back(num_tokens: int, label: str) -> None:
    assert format_tokens(num_tokens) == label
    assert parse_tokens(label) == num_tokens


def sweep_points(policies: list[str], capacities: list[int]) -> list[SweepPoint]:
    base = ReplayConfig(tiers=(TierConfig("CPU", 40, 25.0),), block_size=BLOCK)
    return run_sweep(doc_trace(seed=2, num_requests=40), base, policies, capacities)


def test_columns_never_touch_even_for_huge_ratios() -> None:
    points = sweep_points(["lru", "belady"], [40])
    lru = points[0]
    tiny = dataclasses.replace(lru.result, token_hit_ratio=points[1].result.token_hit_ratio / 1302)
    points[0] = dataclasses.replace(lru, result=tiny)  # x LRU of Belady: 1302.00
    lines = format_table(points).splitlines()
    assert len(re.split(r"\s{2,}", lines[0].strip())) == NUM_COLUMNS
    for line in lines[2:]:
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == NUM_COLUMNS, line
    assert "1302.00" in lines[3]


@pytest.mark.parametrize(
    ("options", "title", "cell"),
    [
        (["--gpu-capacity", "400", "--disk", "160"], "hit per tier", "GPU:"),
        (["--disk", "160", "--cascade", "write_back"], "hit per tier, cascade blocks", "to-disk:"),
    ],
)
def test_the_per_tier_column_has_a_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], title: str, cell: str
) -> None:
    """The per-tier hit ratios followed the last column without a header of their own."""
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=30))
    argv = [str(trace), "--block-size", str(BLOCK), "--quiet", "--capacity", "80", *options]
    assert main(argv) == 0
    header, rule, row = capsys.readouterr().out.splitlines()[1:4]
    assert re.split(r"\s{2,}", header)[-1] == title
    assert rule == "-" * len(header)
    tiers = re.split(r"\s{2,}", row)[-1]
    assert row.index(tiers) == header.index(title), "the header starts where its cells do"
    assert cell in tiers


def test_table_labels_tell_capacities_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=30))
    argv = [str(trace), "--block-size", str(BLOCK), "--quiet", "--capacity", "1000001"]
    assert main([*argv, "--capacity", "1M", "--capacity", "10G"]) == 0
    rows = capsys.readouterr().out.splitlines()[3:6]
    assert [row.split()[1] for row in rows] == ["1000001", "1M", "10G"]


def test_sweep_plot_marks_every_policy_at_a_single_capacity() -> None:
    points = sweep_points(["arc", "oracle-lfu", "lru", "belady"], [40])
    fig = sweep_figure(points, "one capacity", 0.5)
    try:
        lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
        for label in ("arc", "oracle-lfu (offline)", "LRU (peers' policy)", "0.8 x Belady"):
            assert lines[label].get_marker() not in (None, "", "None"), label
        assert lines["Belady (offline reference)"].get_marker() not in (None, "", "None")
    finally:
        plt.close(fig)


def test_the_plots_ceiling_behind_a_gpu_tier_is_what_the_gpu_leaves() -> None:
    """The plot shows lower-tier hit ratios; behind a GPU tier (LRU, the same at every
    point) an infinite lower tier serves every reuse the GPU misses: infinite - GPU."""
    records = doc_trace(seed=2, num_requests=40)
    seen: set[int] = set()
    reused = 0
    for record in records:  # the trace's infinite-cache hit tokens, restated
        n = 0
        while n < len(record.hash_ids) and record.hash_ids[n] in seen:
            n += 1
        reused += min(n * BLOCK, record.input_length)
        seen.update(record.hash_ids)
    infinite = reused / sum(r.input_length for r in records)
    base = ReplayConfig(
        tiers=(TierConfig("CPU", 40, 25.0),), gpu_capacity_tokens=20 * BLOCK, block_size=BLOCK
    )
    points = run_sweep(records, base, ["lru"], [len(seen) * BLOCK])
    gpu = points[0].result.gpu
    assert gpu is not None
    assert gpu.token_hit_ratio > 0
    assert points[0].result.token_hit_ratio == pytest.approx(infinite - gpu.token_hit_ratio)
    fig = sweep_figure(points, "behind a GPU", infinite)
    try:
        (ceiling,) = [line for line in fig.axes[0].get_lines() if "infinite" in line.get_label()]
        assert ceiling.get_ydata()[0] == pytest.approx(infinite - gpu.token_hit_ratio)
    finally:
        plt.close(fig)
