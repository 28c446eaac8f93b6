"""The offline policies' bypass on a tie: a block is stored only if it ranks strictly
below the block it would evict (`oracle-lfu` ranks by uses left, so ties are common;
found by a mutation run: admitting on a tie passed every other test)."""

from __future__ import annotations

from kvtier.replay.tier_replay import ReplayConfig, TierConfig, replay_trace
from kvtier.replay.trace import TraceRecord

BLOCK = 4


def test_oracle_lfu_keeps_the_cached_block_when_the_new_one_has_as_many_uses_left() -> None:
    """One block of room. Key 1 (4 tokens) is cached; key 2 (2 tokens: a partial block)
    comes with one use left, as many as key 1: it is not stored, so request 2 hits
    key 1's 4 tokens and request 3 misses key 2 (swapping them would hit 2 tokens)."""
    records = [
        TraceRecord(0, 4, 1, (1,)),
        TraceRecord(1, 2, 1, (2,)),
        TraceRecord(2, 4, 1, (1,)),
        TraceRecord(3, 2, 1, (2,)),
    ]
    config = ReplayConfig(
        tiers=(TierConfig("CPU", BLOCK, 25.0),),
        policy="oracle-lfu",
        block_size=BLOCK,
        check_every=1,
    )
    result = replay_trace(records, config)
    (cpu,) = result.tiers
    assert (cpu.hit_tokens, cpu.num_stored_blocks, cpu.num_rejected_blocks) == (4, 1, 2)
