"""Write-through's refresh of DISK copies when the GPU tier serves part of the prefix:
the request's blocks rejoin DISK's recency order last position first (SPEC §4), also
when a stored block sits before the CPU tier's hits."""

from __future__ import annotations

from kvtier.core.keys import Key, make_key
from kvtier.replay.tier_replay import CascadeMode, ReplayConfig, TierConfig, TierReplay
from kvtier.replay.trace import TraceRecord

BLOCK = 4


def _key(hash_id: int) -> Key:
    return make_key(hash_id.to_bytes(8, "little"), 0)


def test_disk_copies_refresh_root_last_when_the_gpu_served_the_root() -> None:
    """GPU 2 blocks, CPU 3, DISK 4, LRU. In the last request (ids 1, 2) the GPU serves 1
    and the CPU tier serves 2; the CPU tier lacks 1 and stores it. Both DISK copies
    are refreshed, freed 2 then 1: DISK evicts 3, then 4, then 2, then 1."""
    ids = [(1, 2), (3,), (1, 2), (4,), (1, 2)]
    records = [TraceRecord(i, len(r) * BLOCK, 1, r) for i, r in enumerate(ids)]
    tiers = (TierConfig("CPU", 3 * BLOCK, 25.0), TierConfig("DISK", 4 * BLOCK, 5.0))
    mode = CascadeMode.WRITE_THROUGH
    replay = TierReplay(records, ReplayConfig(tiers, "lru", 2 * BLOCK, BLOCK, cascade=mode))
    result = replay.run()
    cpu, disk = result.tiers
    assert (cpu.num_hit_blocks, cpu.num_stored_blocks, disk.num_hit_blocks) == (2, 5, 0)
    pool = replay.tiers[1].pool
    order = [pool.key(b) for b in pool.iter_free_after(None)]
    assert order == [_key(3), _key(4), _key(2), _key(1)]
