"""A sweep row's columns behind a GPU tier (found by a mutation run: every sweep test ran
without a GPU tier, where the lower tiers' hit ratio equals the total one)."""

from __future__ import annotations

from kvtier.replay.sweep import hit_ratio_table, point_row, run_sweep
from kvtier.replay.tier_replay import ReplayConfig, TierConfig
from kvtier.replay.trace import TraceRecord

BLOCK = 4


def test_a_row_behind_a_gpu_tier_keeps_the_lower_tiers_ratio_apart_from_the_total() -> None:
    """A one-block GPU tier: request 2 hits the CPU (key 0 left the GPU for key 1), request
    3 hits the GPU. Of 16 prompt tokens the CPU serves 4, GPU and CPU together 8."""
    records = [TraceRecord(t, BLOCK, 1, (h,)) for t, h in enumerate((0, 1, 0, 0))]
    base = ReplayConfig((TierConfig("CPU", 8 * BLOCK, 1.0),), "lru", BLOCK, BLOCK)
    points = run_sweep(records, base, ["lru"], [8 * BLOCK])
    row = point_row(points[0], hit_ratio_table(points))
    assert row["token_hit_ratio"] == 0.25
    assert row["total_token_hit_ratio"] == 0.5
    assert row["gpu_token_hit_ratio"] == 0.25
    assert row["cpu_token_hit_ratio"] == 0.25
