"""`TierReplay.check_invariants`, the hook the replay tests call after every request:
it must fail on a state the replay never leaves (a tier block still pinned between
requests), or the tests that rely on it could not see such a leak."""

from __future__ import annotations

import pytest

from kvtier.replay.tier_replay import ReplayConfig, TierConfig, TierReplay
from kvtier.replay.trace import TraceRecord

BLOCK = 4


def test_check_invariants_fails_on_a_tier_block_left_pinned_between_requests() -> None:
    """Between requests every tier block is free; a block still referenced (a load or
    store pin never released) fails the check, though the pool itself is consistent."""
    records = [TraceRecord(0, 2 * BLOCK, 1, (1, 2)), TraceRecord(1, 2 * BLOCK, 1, (1, 2))]
    config = ReplayConfig((TierConfig("CPU", 4 * BLOCK, 25.0),), "lru", 0, BLOCK)
    replay = TierReplay(records, config)
    replay.run()
    replay.check_invariants()
    (tier,) = replay.tiers
    (block_id,) = tier.pool.lookup(replay.keys[0][:1])
    tier.pool.touch([block_id])
    tier.pool.check_invariants()  # a pinned block is a valid pool state
    with pytest.raises(AssertionError, match="a tier block stays pinned"):
        replay.check_invariants()
