"""Run many (policy, capacity) replays of one trace; tabulate, write CSV, JSON and a plot.

Each point is one pass over the trace (`TierReplay`); keys and the Belady oracle are
built once and shared. The capacity of a point is the first lower tier's; a GPU tier and
further lower tiers (a cascade's DISK tier too) keep the capacities of the base
configuration.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.core.keys import Key
from kvtier.replay.belady import BELADY, OFFLINE_POLICIES
from kvtier.replay.config import ReplayConfig, ReplayResult
from kvtier.replay.gpu_tier import first_tier_oracle
from kvtier.replay.tier_replay import TierReplay, max_blocks_held, trace_keys
from kvtier.replay.trace import TraceRecord, TraceSummary
from kvtier.replay.whole_file import whole_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_SWEEP_TOKENS = (
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
LRU = "lru"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepPoint:
    """One replay of the sweep."""

    policy: str
    capacity_tokens: int
    result: ReplayResult


def run_sweep(
    records: Sequence[TraceRecord],
    base: ReplayConfig,
    policies: Sequence[str],
    capacities: Sequence[int],
    on_request_batch: Callable[[int], None] | None = None,
    keys: Sequence[Sequence[Key]] | None = None,
) -> list[SweepPoint]:
    """Replay every (policy, capacity) pair, policies outermost. `keys`: the records' keys
    as `trace_keys(records, base.block_size)` returns them (None: computed here, which
    checks the records; given, they are not checked: `kvtier replay`'s were read)."""
    if keys is None:
        keys = trace_keys(records, base.block_size)
    # The first tier's oracle depends on the GPU tier only: one for the whole sweep.
    oracle = None
    if set(policies) & set(OFFLINE_POLICIES):
        oracle = first_tier_oracle(records, base, keys, max_blocks_held(keys), on_request_batch)
    points = []
    for policy in policies:
        for capacity in capacities:
            first = dataclasses.replace(base.tiers[0], capacity_tokens=capacity)
            config = dataclasses.replace(base, policy=policy, tiers=(first, *base.tiers[1:]))
            replay = TierReplay(records, config, keys, oracle, progress=on_request_batch)
            result = replay.run(on_request_batch)
            points.append(SweepPoint(policy, capacity, result))
            logger.info(  # `kvtier replay -v`: each point as it is done
                "%s at %d tokens: lower-tier token hit ratio %.4f, %.1f s (point %d of %d)",
                policy,
                capacity,
                result.token_hit_ratio,
                result.runtime_s,
                len(points),
                len(policies) * len(capacities),
            )
    return points


def sweep_passes(base: ReplayConfig, policies: Sequence[str], capacities: Sequence[int]) -> int:
    """Return how many passes over the trace `run_sweep` makes (a progress bar's total).

    One per point; an offline policy's point adds one per tier behind another (a replay
    of the tiers in front), and the sweep one pass of a GPU tier alone.
    """
    num_offline = sum(policy in OFFLINE_POLICIES for policy in policies)
    passes = len(policies) * len(capacities)
    passes += num_offline * len(capacities) * (len(base.tiers) - 1)
    return passes + int(num_offline > 0 and bool(base.gpu_capacity_tokens))


def hit_ratio_table(points: Sequence[SweepPoint]) -> dict[str, dict[int, float]]:
    """Return {policy: {capacity: lower-tier token hit ratio}}."""
    table: dict[str, dict[int, float]] = {}
    for p in points:
        table.setdefault(p.policy, {})[p.capacity_tokens] = p.result.token_hit_ratio
    return table


def _ratio(value: float, reference: float | None) -> float | None:
    if reference is None or reference <= 0:
        return None
    return value / reference


def point_row(point: SweepPoint, table: dict[str, dict[int, float]]) -> dict[str, Any]:
    """Return one flat row (CSV / JSON) describing `point`."""
    r = point.result
    row: dict[str, Any] = {
        "policy": point.policy,
        "capacity_tokens": point.capacity_tokens,  # the first lower tier's, swept
        "token_hit_ratio": round(r.token_hit_ratio, 6),
        "total_token_hit_ratio": round(r.total_token_hit_ratio, 6),
        "gpu_token_hit_ratio": round(r.gpu.token_hit_ratio, 6) if r.gpu else 0.0,
    }
    for tier in r.tiers:
        row[f"{tier.name.lower()}_token_hit_ratio"] = round(tier.token_hit_ratio, 6)
    ratio_belady = _ratio(r.token_hit_ratio, table.get(BELADY, {}).get(point.capacity_tokens))
    ratio_lru = _ratio(r.token_hit_ratio, table.get(LRU, {}).get(point.capacity_tokens))
    row.update(
        {
            "x_belady": None if ratio_belady is None else round(ratio_belady, 4),
            "x_lru": None if ratio_lru is None else round(ratio_lru, 4),
            "blocks_stored": sum(t.num_stored_blocks for t in r.tiers),
            "blocks_evicted": sum(t.num_evicted_blocks for t in r.tiers),
            "blocks_rejected": sum(t.num_rejected_blocks for t in r.tiers),
            "blocks_dropped_full": sum(t.num_dropped_blocks for t in r.tiers),
            "cascade": None if r.cascade is None else r.cascade.value,
            "blocks_demoted": sum(t.num_demoted_blocks for t in r.tiers),
            "blocks_promoted": sum(t.num_promoted_blocks for t in r.tiers),
            "bytes_stored": sum(t.bytes_stored for t in r.tiers),
            "bytes_loaded": sum(t.bytes_loaded for t in r.tiers),
            "mean_ttft_s": round(r.mean_ttft_s, 6),
            "mean_ttft_no_cache_s": round(r.mean_ttft_no_cache_s, 6),
            "runtime_s": round(r.runtime_s, 3),
        }
    )
    for tier in r.tiers:  # the sums above, per lower tier
        name = tier.name.lower()
        row[f"{name}_blocks_stored"] = tier.num_stored_blocks
        row[f"{name}_blocks_evicted"] = tier.num_evicted_blocks
        row[f"{name}_bytes_stored"] = tier.bytes_stored
        row[f"{name}_bytes_loaded"] = tier.bytes_loaded
    # Every tier's capacity, as the table shows them (last: the columns before keep
    # their places in the CSV).
    row["gpu_capacity_tokens"] = r.gpu.capacity_tokens if r.gpu else 0
    for tier in r.tiers:
        row[f"{tier.name.lower()}_capacity_tokens"] = tier.capacity_tokens
    return row


def write_csv(path: str | Path, points: Sequence[SweepPoint]) -> None:
    """Write one row per point (all of them, or `path` is untouched)."""
    table = hit_ratio_table(points)
    rows = [point_row(p, table) for p in points]
    with whole_file(path) as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_json(
    path: str | Path,
    points: Sequence[SweepPoint],
    trace: str,
    summary: TraceSummary,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write every point's row, the hit-ratio table and the trace summary as JSON."""
    table = hit_ratio_table(points)
    payload = {
        "trace": trace,
        "summary": dataclasses.asdict(summary),
        "token_hit_ratio": {p: {str(c): v for c, v in caps.items()} for p, caps in table.items()},
        "points": [point_row(p, table) for p in points],
        **(extra or {}),
    }
    with whole_file(path) as file:
        file.write(json.dumps(payload, indent=2) + "\n")


def plot_sweep(
    path: str | Path, points: Sequence[SweepPoint], title: str, infinite_hit_ratio: float
) -> None:
    """Plot hit ratio vs capacity per policy; LRU dashed, Belady as the bound (PNG)."""
    fig = sweep_figure(points, title, infinite_hit_ratio)
    import matplotlib.pyplot as plt

    try:
        with whole_file(path, binary=True) as file:
            fig.savefig(file, format=Path(path).suffix.lstrip(".").lower() or "png", dpi=120)
    finally:
        plt.close(fig)


def _lower_tier_ceiling(
    points: Sequence[SweepPoint], infinite_hit_ratio: float
) -> tuple[float, str]:
    """Return the most the plotted (lower-tier) hit ratio can reach, and its label.

    The GPU tier in front is LRU and independent of the tiers behind, so it serves the
    same tokens at every point; an infinite lower tier serves every other reuse.
    """
    gpu = points[0].result.gpu if points else None
    if gpu is None:
        return infinite_hit_ratio, "infinite cache"
    return max(0.0, infinite_hit_ratio - gpu.token_hit_ratio), "infinite cache (behind the GPU)"


def sweep_figure(points: Sequence[SweepPoint], title: str, infinite_hit_ratio: float) -> Figure:
    """Return the sweep plot; the caller closes it (`plt.close`).

    `infinite_hit_ratio` is the whole trace's (`summarize`); the plot's ceiling line
    takes a GPU tier's hits off it, as its curves are the lower tiers' hit ratios.

    Every policy's line carries markers, so a sweep of a single capacity still shows
    each policy (a point of a line without markers is invisible). Selects the Agg
    backend (files, no display).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = hit_ratio_table(points)
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, caps in table.items():
        xs = sorted(caps)
        ys = [caps[x] for x in xs]
        if policy == BELADY:
            ax.plot(
                xs,
                ys,
                "k-",
                marker="s",
                markersize=5,
                linewidth=2.5,
                label="Belady (offline reference)",
            )
        elif policy == LRU:
            ax.plot(xs, ys, "k--", marker="o", markersize=3, label="LRU (peers' policy)")
        elif policy in OFFLINE_POLICIES:
            ax.plot(
                xs,
                ys,
                color="grey",
                linestyle="-.",
                marker="^",
                markersize=5,
                label=f"{policy} (offline)",
            )
        else:
            ax.plot(xs, ys, marker="o", markersize=3, label=policy)
    if BELADY in table:
        xs = sorted(table[BELADY])
        target = [0.8 * table[BELADY][x] for x in xs]
        ax.plot(
            xs,
            target,
            color="black",
            linewidth=0.8,
            linestyle=":",
            marker="_",
            markersize=8,
            label="0.8 x Belady",
        )
    ceiling, label = _lower_tier_ceiling(points, infinite_hit_ratio)
    ax.axhline(ceiling, color="grey", linestyle=":", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("lower-tier capacity (tokens)")
    ax.set_ylabel("token hit ratio")
    ax.set_ylim(0, 1)
    ax.set_title(title, parse_math=False)  # a file name: `$` is no math
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig
