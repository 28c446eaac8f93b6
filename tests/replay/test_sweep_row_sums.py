"""A sweep's rows, order, grid and JSON, pinned against the replay results they come
from (found by the first mutation run on sweep.py: a row summing one tier's evictions
instead of all tiers', bytes stored as bytes loaded, the no-cache TTFT as the TTFT, the
policies' nesting swapped, or the JSON without its trace summary all passed)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay.sweep import (
    DEFAULT_SWEEP_TOKENS,
    hit_ratio_table,
    plot_sweep,
    point_row,
    run_sweep,
    sweep_figure,
    write_json,
)
from kvtier.replay.tier_replay import ReplayConfig, TierConfig
from kvtier.replay.trace import TraceRecord, summarize

TWO_TIERS = ReplayConfig(
    (TierConfig.named("CPU", 6 * BLOCK), TierConfig.named("DISK", 12 * BLOCK)),
    "lru",
    block_size=BLOCK,
)


def test_the_default_grid_is_the_issues_sweep() -> None:
    """`--sweep` without `--capacity` runs 100 k ... 30 M tokens (issue 6's sweep), at the
    columns of docs/policies.md's tables."""
    assert DEFAULT_SWEEP_TOKENS == (
        100_000,
        200_000,
        300_000,
        500_000,
        1_000_000,
        2_000_000,
        3_000_000,
        5_000_000,
        10_000_000,
        20_000_000,
        30_000_000,
    )


def test_a_row_sums_every_lower_tier_and_names_each() -> None:
    """With a CPU and a DISK tier both evicting, the row's totals are the sums over both
    tiers, and each tier's own counts are its columns."""
    points = run_sweep(doc_trace(seed=3, num_requests=80), TWO_TIERS, ["lru"], [6 * BLOCK])
    result = points[0].result
    cpu, disk = result.tiers
    assert min(cpu.num_evicted_blocks, disk.num_evicted_blocks) > 0
    assert min(cpu.bytes_loaded, disk.bytes_loaded) > 0
    row = point_row(points[0], hit_ratio_table(points))
    assert row["blocks_stored"] == cpu.num_stored_blocks + disk.num_stored_blocks
    assert row["blocks_evicted"] == cpu.num_evicted_blocks + disk.num_evicted_blocks
    assert row["bytes_stored"] == cpu.bytes_stored + disk.bytes_stored
    assert row["bytes_loaded"] == cpu.bytes_loaded + disk.bytes_loaded
    assert row["bytes_loaded"] != row["bytes_stored"]
    assert (row["cpu_bytes_loaded"], row["disk_bytes_loaded"]) == (
        cpu.bytes_loaded,
        disk.bytes_loaded,
    )
    assert row["mean_ttft_s"] == round(result.mean_ttft_s, 6)
    assert row["token_hit_ratio"] == round(result.token_hit_ratio, 6)
    assert row["token_hit_ratio"] != round(result.token_hit_ratio, 3)
    assert row["mean_ttft_s"] < row["mean_ttft_no_cache_s"]
    assert row["gpu_token_hit_ratio"] == 0.0  # no GPU tier: it serves nothing


def test_policies_are_outermost_and_ratios_keep_four_places() -> None:
    """Rows come policy by policy, each over every capacity; `x_belady` / `x_lru` are the
    ratios to Belady's and LRU's hit ratio at that capacity, rounded to 4 places."""
    records = doc_trace(seed=3, num_requests=80)
    capacities = [6 * BLOCK, 9 * BLOCK]
    points = run_sweep(records, TWO_TIERS, ["arc", "belady", "lru"], capacities)
    assert [(p.policy, p.capacity_tokens) for p in points] == [
        (policy, capacity) for policy in ("arc", "belady", "lru") for capacity in capacities
    ]
    table = hit_ratio_table(points)
    for point in points:
        row = point_row(point, table)
        ratio = point.result.token_hit_ratio
        assert row["x_belady"] == round(ratio / table["belady"][point.capacity_tokens], 4)
        assert row["x_lru"] == round(ratio / table["lru"][point.capacity_tokens], 4)
    assert any(len(str(point_row(p, table)["x_belady"])) > 4 for p in points)


def test_a_reference_of_no_hits_gives_no_ratio() -> None:
    """A trace that reuses nothing: LRU and Belady hit nothing, and the ratios to them
    are None (not a division by zero)."""
    records = [TraceRecord(t, BLOCK, 1, (t,)) for t in range(5)]
    base = dataclasses.replace(TWO_TIERS, tiers=TWO_TIERS.tiers[:1])
    points = run_sweep(records, base, ["lru", "belady"], [2 * BLOCK])
    table = hit_ratio_table(points)
    assert table == {"lru": {2 * BLOCK: 0.0}, "belady": {2 * BLOCK: 0.0}}
    rows = [point_row(p, table) for p in points]
    assert [(r["x_belady"], r["x_lru"]) for r in rows] == [(None, None), (None, None)]


def test_the_json_carries_the_trace_summary_and_every_point(tmp_path: Path) -> None:
    """`--json` holds the trace's name, its summary, the hit-ratio table and each row."""
    records = doc_trace(seed=3, num_requests=40)
    points = run_sweep(records, TWO_TIERS, ["lru", "belady"], [6 * BLOCK, 9 * BLOCK])
    summary = summarize(records, BLOCK)
    path = tmp_path / "r.json"
    write_json(path, points, "doc.jsonl", summary, {"note": 1})
    payload = json.loads(path.read_text())
    assert list(payload) == ["trace", "summary", "token_hit_ratio", "points", "note"]
    assert payload["summary"] == dataclasses.asdict(summary)
    assert len(payload["points"]) == 4
    table = hit_ratio_table(points)
    assert payload["points"] == [json.loads(json.dumps(point_row(p, table))) for p in points]


def test_rejected_blocks_are_the_admission_filters_refusals() -> None:
    """`blocks_rejected` sums the blocks the admission filter refused (`lru+door`), apart
    from those dropped because a tier was full."""
    points = run_sweep(doc_trace(seed=3, num_requests=80), TWO_TIERS, ["lru+door"], [6 * BLOCK])
    tiers = points[0].result.tiers
    row = point_row(points[0], hit_ratio_table(points))
    assert row["blocks_rejected"] == sum(t.num_rejected_blocks for t in tiers) > 0
    assert row["blocks_dropped_full"] == sum(t.num_dropped_blocks for t in tiers)
    assert row["blocks_rejected"] != row["blocks_dropped_full"]


def test_the_plot_is_log_scaled_with_the_target_at_0_8_belady() -> None:
    """Capacities span 100 k ... 30 M: the x axis is logarithmic; the target line is
    0.8 x Belady (issue 6's target) at each capacity."""
    import matplotlib.pyplot as plt

    records = doc_trace(seed=3, num_requests=40)
    points = run_sweep(records, TWO_TIERS, ["lru", "belady"], [6 * BLOCK, 9 * BLOCK])
    fig = sweep_figure(points, "target", 0.5)
    try:
        axes = fig.axes[0]
        assert axes.get_xscale() == "log"
        lines = {line.get_label(): line for line in axes.get_lines()}
        belady = hit_ratio_table(points)["belady"]
        target = [0.8 * belady[c] for c in sorted(belady)]
        assert list(lines["0.8 x Belady"].get_ydata()) == pytest.approx(target)
    finally:
        plt.close(fig)


def test_the_plot_takes_the_format_of_its_suffix(tmp_path: Path) -> None:
    """`plot_sweep` to `sweep.svg` writes an SVG, not a PNG under that name."""
    records = doc_trace(seed=3, num_requests=20)
    points = run_sweep(records, TWO_TIERS, ["lru"], [6 * BLOCK])
    plot_sweep(tmp_path / "sweep.svg", points, "svg", 0.5)
    plot_sweep(tmp_path / "sweep.png", points, "png", 0.5)
    assert b"<svg" in (tmp_path / "sweep.svg").read_bytes()[:500]
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


def test_a_json_write_that_fails_leaves_the_old_file(tmp_path: Path) -> None:
    """`--json` is written whole or not at all: a value JSON cannot hold fails the write,
    and the file keeps what it held (not an empty or half-written file)."""
    records = doc_trace(seed=3, num_requests=20)
    points = run_sweep(records, TWO_TIERS, ["lru"], [6 * BLOCK])
    path = tmp_path / "r.json"
    path.write_text("old\n")
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(path, points, "doc.jsonl", summarize(records, BLOCK), {"bad": object()})
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["r.json"]
