"""A tier's capacity is in tokens: it holds only whole blocks (found by a mutation run:
rounding the block count up passed every other test)."""

from __future__ import annotations

from kvtier.replay.tier_replay import ReplayConfig, TierConfig, replay_trace
from kvtier.replay.trace import TraceRecord

BLOCK = 4


def test_a_capacity_between_two_block_counts_holds_the_smaller_one() -> None:
    """6 tokens hold one 4-token block: key 2 evicts key 1, so request 2 misses."""
    records = [TraceRecord(t, BLOCK, 1, (h,)) for t, h in enumerate((1, 2, 1))]
    config = ReplayConfig(tiers=(TierConfig("CPU", 6, 25.0),), block_size=BLOCK, check_every=1)
    (cpu,) = replay_trace(records, config).tiers
    assert cpu.num_blocks == 1
    assert (cpu.hit_tokens, cpu.num_stored_blocks, cpu.num_evicted_blocks) == (0, 3, 2)
