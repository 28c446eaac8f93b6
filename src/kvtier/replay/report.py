"""The text output of `kvtier replay`: token-count labels and the results table."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.replay.sweep import SweepPoint, hit_ratio_table, point_row

_UNITS = (("G", 1_000_000_000), ("M", 1_000_000), ("k", 1_000))
_HEADER = (
    "policy",
    "capacity",
    "hit",
    "xBelady",
    "xLRU",
    "stored",
    "evicted",
    "GB stored",
    "GB loaded",
    "TTFT s",
)
# The last column: each tier's token hit ratio (GPU first, when there is one), then a
# cascade's block counts; left-aligned, as wide as each row needs.
_TIERS_HEADER = "hit per tier"
_CASCADE_HEADER = "hit per tier, cascade blocks"
_GAP = "  "  # between columns: columns never touch, whatever their widths


def format_tokens(num_tokens: int) -> str:
    """Return `num_tokens` as an exact label: 300k, 1.5M, 10G, 1000001.

    A unit is used when it leaves at most two decimals and fewer than 1,000 units (G
    always), so two different counts never share a label and `parse_tokens` reads a
    label back as the same count.
    """
    for suffix, unit in _UNITS:
        if num_tokens < unit or num_tokens * 100 % unit:
            continue
        whole, cents = divmod(num_tokens * 100 // unit, 100)
        if whole < 1000 or suffix == "G":
            return f"{whole}.{cents:02d}".rstrip("0").rstrip(".") + suffix
    return str(num_tokens)


def format_table(points: Sequence[SweepPoint]) -> str:
    """Return the results as an aligned text table, one row per point.

    Each column is as wide as its widest cell and columns are two spaces apart; the
    last column, "hit per tier", holds each tier's hit ratio (and a cascade's blocks
    moved to disk and promoted), as long as each row needs.
    """
    table = hit_ratio_table(points)
    tiers = _capacity_tiers(points)
    capacities = [f"{name} capacity" for name in tiers] if len(tiers) > 1 else [_HEADER[1]]
    titles = [_HEADER[0], *capacities, *_HEADER[2:]]
    rows = [_cells(point, table, tiers) for point in points]
    widths = [
        max([len(title)] + [len(cells[i]) for cells, _ in rows]) for i, title in enumerate(titles)
    ]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return _GAP.join([first, *rest])

    has_cascade = any(point.result.cascade is not None for point in points)
    header = line(titles) + _GAP + (_CASCADE_HEADER if has_cascade else _TIERS_HEADER)
    lines = [header, "-" * len(header)]
    lines += [f"{line(cells)}{_GAP}{tiers}" for cells, tiers in rows]
    return "\n".join(lines)


def _capacity_tiers(points: Sequence[SweepPoint]) -> list[str]:
    """Return the names of the tiers the points have (GPU first, when there is one), each
    shown with its capacity: with one tier, the column is just "capacity"."""
    gpu = ["GPU"] if any(point.result.gpu is not None for point in points) else []
    lower = (tier.name for point in points for tier in point.result.tiers)
    return gpu + list(dict.fromkeys(lower))


def _cells(
    point: SweepPoint, table: dict[str, dict[int, float]], tiers: Sequence[str]
) -> tuple[list[str], str]:
    """Return a point's table cells and its per-tier hit ratios."""
    row = point_row(point, table)
    result = point.result
    capacities = {tier.name: tier.capacity_tokens for tier in result.tiers}
    capacities[result.tiers[0].name] = point.capacity_tokens  # the sweep's, as the JSON's
    if result.gpu is not None:
        capacities["GPU"] = result.gpu.capacity_tokens
    hits = " ".join(f"{t.name}:{t.token_hit_ratio:.3f}" for t in result.tiers)
    if result.gpu is not None:
        hits = f"GPU:{result.gpu.token_hit_ratio:.3f} " + hits
    if result.cascade is not None:
        cpu = result.tiers[0]
        hits += f" to-disk:{cpu.num_demoted_blocks} promoted:{cpu.num_promoted_blocks}"
    cells = [
        point.policy,
        *(format_tokens(capacities[name]) if name in capacities else "-" for name in tiers),
        f"{result.token_hit_ratio:.3f}",
        "-" if row["x_belady"] is None else f"{row['x_belady']:.2f}",
        "-" if row["x_lru"] is None else f"{row['x_lru']:.2f}",
        str(row["blocks_stored"]),
        str(row["blocks_evicted"]),
        f"{row['bytes_stored'] / 1e9:.1f}",
        f"{row['bytes_loaded'] / 1e9:.1f}",
        f"{row['mean_ttft_s']:.3f}",
    ]
    return cells, hits
