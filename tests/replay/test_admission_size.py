"""An admission filter keeps the configured tier's size when the pool is capped to what the
trace can hold (found by a mutation run: sizing `door` by the capped pool passed every
other test, though its Bloom filter then admits first sightings by false positive)."""

from __future__ import annotations

import random

from kvtier.replay.tier_replay import ReplayConfig, TierConfig, replay_trace
from kvtier.replay.trace import TraceRecord

BLOCK = 16


def test_door_refuses_every_first_sighting_in_a_large_tier() -> None:
    """3,000 distinct blocks, each offered once, to a tier of 65,536 blocks: its filter
    (2 Mbit) gives no false positive here; one sized for the 3,000 blocks the trace can
    hold (64 kbit) admitted 2 of them."""
    rng = random.Random(3000)
    records = [TraceRecord(t, BLOCK, 0, (rng.getrandbits(63),)) for t in range(3000)]
    config = ReplayConfig((TierConfig("CPU", (1 << 16) * BLOCK, 1.0),), "lru+door", 0, BLOCK)
    (cpu,) = replay_trace(records, config).tiers
    assert (cpu.num_stored_blocks, cpu.num_rejected_blocks) == (0, 3000)
