"""The cascade's block counts where the CPU tier cannot store everything DISK served:
`promoted` counts the DISK-served blocks the CPU tier stored, not every DISK hit."""

from __future__ import annotations

import pytest

from kvtier.replay.tier_replay import CascadeMode, ReplayConfig, TierConfig, replay_trace
from kvtier.replay.trace import TraceRecord

BLOCK = 4


@pytest.mark.parametrize("mode", list(CascadeMode))
def test_promoted_counts_only_the_disk_hits_the_cpu_tier_stored(mode: CascadeMode) -> None:
    """GPU 3 blocks, CPU 2, DISK 6. Before request 3 (ids 1, 2, 3) the GPU holds id 1
    but not 2 or 3, the CPU tier none of them, DISK all three: the GPU serves 1, DISK
    2 and 3. The CPU tier stores the ids it lacks in position order: 1 and 2 fill its
    two slots, 3 is dropped. So one DISK-served block was promoted, not two."""
    ids = [(1, 2, 3), (1, 2, 3), (1, 4, 5), (1, 2, 3)]
    records = [TraceRecord(i, len(r) * BLOCK, 1, r) for i, r in enumerate(ids)]
    tiers = (TierConfig("CPU", 2 * BLOCK, 25.0), TierConfig("DISK", 6 * BLOCK, 5.0))
    config = ReplayConfig(tiers, "lru", 3 * BLOCK, BLOCK, cascade=mode, check_every=1)
    result = replay_trace(records, config)
    cpu, disk = result.tiers
    assert result.gpu is not None
    assert result.gpu.num_hit_blocks == 5
    assert (cpu.num_hit_blocks, disk.num_hit_blocks) == (0, 2)
    assert (cpu.num_promoted_blocks, cpu.num_dropped_blocks) == (1, 2)
