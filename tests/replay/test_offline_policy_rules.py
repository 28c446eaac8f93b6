"""Rules of the offline policies the brute-force tests did not tell apart (found by a
mutation run): the bypass on a tie (a block is stored only if it ranks strictly below
the block it would evict; `oracle-lfu` ranks by uses left, so ties are common), and the
listing of unhashed blocks."""

from __future__ import annotations

from kvtier.replay.belady import FutureOracle, make_oracle_policies
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


def test_offline_policies_list_unhashed_blocks_in_the_order_they_reuse_them() -> None:
    """`iter_after` (the pool's listing of its next victims) is `pop_victim`'s order."""
    oracle = FutureOracle([[]])
    eviction, _ = make_oracle_policies("belady", 6, oracle)
    eviction.clear_and_fill(range(1, 4))
    eviction.push_reusable(5)
    eviction.push_reusable(4)
    listed = list(eviction.iter_after(None))
    assert listed == [eviction.pop_victim() for _ in range(5)]
