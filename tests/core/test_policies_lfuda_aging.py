"""LFU-DA's level L only rises: blocks a write-back pinned and then evicts in another
order than `pop_victim`'s do not pull it back (a mutation run found no test evicting a
taken block after one of higher priority)."""

from __future__ import annotations

from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import LFUDAPolicy


def test_lfuda_level_does_not_fall_when_taken_blocks_are_evicted_out_of_order() -> None:
    """Keys 0 and 1 are stored (priority 0 + 1), key 1 and key 2 hit once more (priority
    0 + 2). Blocks of keys 0 and 1 are pinned, then evicted key 1 first: L rises to 2 (the
    lowest priority still queued is key 2's, 2). Evicting key 0 (priority 1) after it
    leaves L at 2, and a block stored next gets priority L + 1 = 3, not 2."""
    policy = LFUDAPolicy(6)
    pool = BlockPool(6, free_queue=policy)
    low = store(pool, policy, key(0))
    high = store(pool, policy, key(1))
    store(pool, policy, key(2))
    hit(pool, key(1))
    hit(pool, key(2))
    assert (policy._priority[low], policy._priority[high]) == (1, 2)
    pool.pin([low, high])
    pool.release_evicted(high)
    assert policy.level == 2
    pool.release_evicted(low)
    assert policy.level == 2
    fresh = store(pool, policy, key(3))
    assert policy._priority[fresh] == 3
    pool.check_invariants()
