"""What a tier's store selection counts per candidate: stored, rejected by admission, or
dropped for want of a free slot, in the order `StoreSelector`'s `select_run` decides
(offload/store_runs.py: admission first, then room)."""

from __future__ import annotations

from kvtier.replay.tier_replay import ReplayConfig, TierConfig, replay_trace
from kvtier.replay.trace import TraceRecord

BLOCK = 4


def test_a_candidate_met_with_a_full_tier_is_still_asked_for_admission() -> None:
    """One slot, Belady. Request 0 stores key 1 (used again) in the only slot; its key 2
    is never used again, so admission refuses it before any slot is looked for: rejected,
    not dropped (asked first, an admission filter such as `door` also records the
    sighting, as the scheduler's does)."""
    records = [TraceRecord(0, 2 * BLOCK, 1, (1, 2)), TraceRecord(1, BLOCK, 1, (1,))]
    config = ReplayConfig((TierConfig("CPU", BLOCK, 25.0),), "belady", 0, BLOCK, check_every=1)
    (cpu,) = replay_trace(records, config).tiers
    assert (cpu.num_stored_blocks, cpu.num_rejected_blocks, cpu.num_dropped_blocks) == (1, 1, 0)
    assert cpu.num_hit_blocks == 1
