"""`TierIndex` over two tiers (`offload/tier_index.py`): ids of the second are offset by
the first pool's size, and a block's token tag answers for its primary key only, in
either tier."""

from __future__ import annotations

import pytest
from test_cascade_demotions import key

from kvtier.core.block_pool import BlockPool
from kvtier.offload.plan import Tier
from kvtier.offload.tier_index import TierIndex


def test_a_disk_blocks_tag_is_its_primary_keys_not_a_secondary_keys() -> None:
    """Disk block 1 holds key 1 tagged and key 2 as a secondary key (a fine-grained
    entry, no tag of its own): asked for key 2, the index has no tag (a mutant answered
    key 1's, which the token check then took for a hash collision)."""
    cpu, disk = BlockPool(5), BlockPool(5)
    index = TierIndex([(Tier.CPU, cpu), (Tier.DISK, disk)])
    for pool in (cpu, disk):
        pool.touch([1])
        pool.insert_key(key(1), 1, 4, tag=b"t" * 16)
        pool.insert_key(key(2), 1, 4)
        pool.free([1])
    for block_id in (1, 1 + cpu.num_blocks):  # the CPU block, then the disk block
        assert index.tag(block_id, key(1)) == b"t" * 16
        assert index.tag(block_id, key(2)) is None
        assert index.tag(block_id) == b"t" * 16
    assert index.cached_block(key(2)) == 1


def test_an_index_spans_one_or_two_tiers_only() -> None:
    """No tier, or three, is refused: the shared id space splits at one offset, so a
    third pool's ids would fall in the second's (a mutant accepted three tiers and never
    looked in the third)."""
    cpu, disk, more = BlockPool(5), BlockPool(5), BlockPool(5)
    for pools in ([], [(Tier.CPU, cpu), (Tier.DISK, disk), (Tier.DISK, more)]):
        with pytest.raises(ValueError, match="one or two lower tiers"):
            TierIndex(pools)


def test_unpinning_across_tiers_keeps_each_tiers_order() -> None:
    """Hit blocks unpinned tail first, in both tiers: each tier's blocks join its free
    queue in the order given, so its prefix tails are evicted before their roots (a
    mutant unpinned each tier's blocks in reverse: roots first)."""
    cpu, disk = BlockPool(5), BlockPool(5)
    index = TierIndex([(Tier.CPU, cpu), (Tier.DISK, disk)])
    for pool, base in ((cpu, 0), (disk, 10)):
        pool.touch([1, 2, 3])
        for block_id in (1, 2, 3):
            pool.insert_key(key(base + block_id), block_id, 4)
        pool.free([1, 2, 3])
    offset = cpu.num_blocks
    hit = [1, 2, 3, 1 + offset, 2 + offset, 3 + offset]
    index.touch(hit)
    index.free(hit[::-1])
    for pool in (cpu, disk):
        assert list(pool.iter_free_after(None))[-3:] == [3, 2, 1]
