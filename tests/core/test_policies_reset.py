"""What every eviction policy does on `BlockPool.reset` (`clear_and_fill`): the blocks
come back unhashed and are reused in id order, and what the policy learnt from the
keys it saw (S3-FIFO's ghost, ARC's ghosts, the LFU-DA sketch) is kept. A mutation run
found both untested for the policies other than `lru`."""

from __future__ import annotations

import pytest
from policy_helpers import key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import EVICTION_POLICIES, ARCPolicy, LFUDAPolicy, S3FIFOPolicy


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_after_reset_every_policy_reuses_the_blocks_in_id_order(name: str) -> None:
    policy = EVICTION_POLICIES[name](6)
    pool = BlockPool(6, free_queue=policy)
    for i in range(8):
        store(pool, policy, key(i))
    assert pool.reset()
    policy.check_invariants()
    assert list(pool.iter_free_after(None)) == [1, 2, 3, 4, 5]
    assert pool.allocate(5) == [1, 2, 3, 4, 5]


def test_s3fifo_keeps_its_ghost_across_a_reset() -> None:
    policy = S3FIFOPolicy(5)  # 4 usable blocks: S holds 1, the ghost 3
    pool = BlockPool(5, free_queue=policy)
    for i in range(6):  # keys 0 and 1 evicted from S: ghosts
        store(pool, policy, key(i))
    assert pool.reset()
    assert list(policy._ghost) == [key(0), key(1)]
    policy.check_invariants()


def test_arc_keeps_its_ghosts_across_a_reset() -> None:
    policy = ARCPolicy(5)  # c = 4
    pool = BlockPool(5, free_queue=policy)
    for i in range(6):  # keys 0 and 1 evicted from T1: B1 ghosts
        store(pool, policy, key(i))
    assert pool.reset()
    assert (list(policy._b1), list(policy._b2)) == ([key(0), key(1)], [])
    policy.check_invariants()


def test_lfuda_keeps_its_sketch_across_a_reset() -> None:
    """A key stored twice before the reset is counted on from 2: stored again, its
    block outlives a fresh key's."""
    policy = LFUDAPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    for _ in range(2):
        store(pool, policy, key(0))
        pool.evict_keys(pool.cached_block(key(0)))
    assert pool.reset()
    often = store(pool, policy, key(0))  # count 3, capped at F = 2
    fresh = store(pool, policy, key(1))  # count 1
    assert [b for b in pool.iter_free_after(None) if pool.key(b) is not None] == [fresh, often]
    policy.check_invariants()
