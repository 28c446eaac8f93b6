"""The cells of `kvtier replay`'s results table: which number each column shows, and how
it is rounded (hit ratio 3 decimals, x Belady and x LRU 2, GB = 1e9 bytes with 1
decimal, TTFT seconds 3 decimals)."""

from __future__ import annotations

import dataclasses
import re

from replay_helpers import BLOCK, doc_trace

from kvtier.replay.config import CascadeMode, ReplayConfig, TierConfig
from kvtier.replay.report import format_table
from kvtier.replay.sweep import run_sweep


def test_each_column_shows_its_number_rounded_as_documented() -> None:
    """LRU's row, with its numbers set by hand: hit 0.12345 of Belady's 0.5, 9 blocks
    stored and 7 evicted, 1.5e9 bytes stored and 2.6e9 loaded, a mean TTFT of 12.34 ms."""
    base = ReplayConfig(tiers=(TierConfig("CPU", 40, 25.0),), block_size=BLOCK)
    lru, belady = run_sweep(doc_trace(seed=2, num_requests=40), base, ["lru", "belady"], [40])
    (tier,) = lru.result.tiers
    tier = dataclasses.replace(
        tier,
        num_stored_blocks=9,
        num_evicted_blocks=7,
        bytes_stored=1_500_000_000,
        bytes_loaded=2_600_000_000,
    )
    result = dataclasses.replace(
        lru.result, token_hit_ratio=0.12345, mean_ttft_s=0.01234, tiers=(tier,)
    )
    best = dataclasses.replace(belady.result, token_hit_ratio=0.5)
    points = [dataclasses.replace(lru, result=result), dataclasses.replace(belady, result=best)]
    lines = format_table(points).splitlines()
    row = re.split(r"\s{2,}", lines[2].strip())
    # policy, capacity, hit, xBelady, xLRU, stored, evicted, GB stored, GB loaded, TTFT s
    assert row[:10] == ["lru", "40", "0.123", "0.25", "1.00", "9", "7", "1.5", "2.6", "0.012"]
    # Number columns are right-aligned under their titles.
    assert lines[0].index(" hit ") + len(" hit") == lines[2].index(" 0.123 ") + len(" 0.123")
    assert lines[0].index("TTFT s") + len("TTFT s") == lines[2].index("0.012") + len("0.012")


def test_a_cascade_row_names_blocks_moved_to_disk_then_promoted() -> None:
    """The last cell of a cascade's row: CPU blocks written to DISK (`to-disk`), then
    DISK-served blocks the CPU tier stored (`promoted`), each its own count."""
    base = ReplayConfig(tiers=(TierConfig("CPU", 40, 25.0),), block_size=BLOCK)
    (point,) = run_sweep(doc_trace(seed=2, num_requests=40), base, ["lru"], [40])
    (tier,) = point.result.tiers
    tier = dataclasses.replace(tier, num_demoted_blocks=3, num_promoted_blocks=1)
    result = dataclasses.replace(point.result, tiers=(tier,), cascade=CascadeMode.WRITE_BACK)
    row = format_table([dataclasses.replace(point, result=result)]).splitlines()[2]
    assert row.endswith(" to-disk:3 promoted:1")
