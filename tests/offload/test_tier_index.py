"""`TierIndex` over two tiers (`offload/tier_index.py`): ids of the second are offset by
the first pool's size, and a block's token tag answers for its primary key only, in
either tier."""

from __future__ import annotations

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
