"""ARC's and S3-FIFO's ghost bookkeeping and duel's switch, rule by rule (found by a
mutation run: each test fails when one rule is dropped or changed)."""

from __future__ import annotations

from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import ARCPolicy, DuelingPolicy, S3FIFOPolicy
from kvtier.core.policies import arc as arc_module


def arc_with_b2_twice_b1() -> tuple[ARCPolicy, BlockPool]:
    """Return an ARC pool (4 usable blocks, `p` = 0) with B1 = [key 10], B2 = [key 0] and
    an empty T1, so the next store's victim comes from T2."""
    policy = ARCPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    for i in range(4):  # T2 = keys 0..3
        store(pool, policy, key(i))
        hit(pool, key(i))
    store(pool, policy, key(10))  # T1 is empty: key 0 leaves T2 for B2
    store(pool, policy, key(11))  # T1 = [key 10] > p = 0: key 10 leaves T1 for B1
    hit(pool, key(11))  # key 11 joins T2: T1 is empty again
    assert list(policy._b1) == [key(10)]
    assert list(policy._b2) == [key(0)]
    assert policy.target_t1 == 0.0
    return policy, pool


def test_arc_a_b1_ghost_hit_grows_p_by_the_ratio_of_b2_to_b1() -> None:
    """Storing key 10 evicts key 1 from T2 (B2 = 2 keys, B1 = 1) before the ghost look-up,
    so `p` grows by |B2| / |B1| = 2, not by 1; the block joins T2, and the ghost is gone."""
    policy, pool = arc_with_b2_twice_b1()
    block_id = store(pool, policy, key(10))
    assert list(policy._b2) == [key(0), key(1)]
    assert policy.target_t1 == 2.0
    assert policy._lists.where(block_id) == arc_module._T2, "a B1 ghost hit joins T2"
    assert key(10) not in policy._b1
    policy.check_invariants()


def test_arc_a_b2_ghost_hit_drops_the_ghost_and_joins_t2() -> None:
    """A key stored again from B2 is no ghost any more (it is cached) and joins T2."""
    policy, pool = arc_with_b2_twice_b1()
    block_id = store(pool, policy, key(0))  # key 1 leaves T2 for B2 first
    assert list(policy._b2) == [key(1)]
    assert key(0) not in policy._b1
    assert policy._lists.where(block_id) == arc_module._T2, "a B2 ghost hit joins T2"
    policy.check_invariants()


def test_arc_a_key_evicted_again_is_the_newest_ghost() -> None:
    """Two blocks hold key 0 (the pool allows it); the second one's eviction makes key 0
    B1's newest ghost again, after key 1 evicted in between (the trim forgets the oldest)."""
    policy = ARCPolicy(6)  # 5 usable blocks
    pool = BlockPool(6, free_queue=policy)
    first, other, second = pool.allocate(3)
    pool.insert_key(key(0), first, 16)
    pool.insert_key(key(1), other, 16)
    pool.insert_key(key(0), second, 16)
    pool.free([first, other, second])  # T1 = [first, other, second]
    pool.allocate(3)  # the two unhashed blocks, then `first`
    assert list(policy._b1) == [key(0)]
    pool.allocate(1)  # `other`
    pool.allocate(1)  # `second`: key 0 again
    assert list(policy._b1) == [key(1), key(0)]
    policy.check_invariants()


def test_arc_trims_b2_while_b1_and_t1_together_hold_exactly_c_keys() -> None:
    """The directory trim forgets B1's oldest only while |B1| + |T1| exceeds c (4 here):
    at the last store below B1 and T1 hold exactly 4 keys, so B2's oldest (key 1) goes."""
    policy = ARCPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    for i in (1, 6, 3, 1, 9, 6, 9, 10, 4, 10, 8, 5, 7):  # hit if cached, else store
        if pool.cached_block(key(i)) is None:
            store(pool, policy, key(i))
        else:
            hit(pool, key(i))
    assert list(policy._b1) == [key(3), key(4), key(8)]
    assert list(policy._b2) == [key(6)]
    policy.check_invariants()


def test_s3fifo_ghost_stays_bounded_when_one_allocation_evicts_the_whole_pool() -> None:
    """The ghost is trimmed to M's size at each store; between stores (one allocation
    evicting every block of S) it keeps at most twice that, oldest forgotten first."""
    policy = S3FIFOPolicy(11)  # 10 usable blocks: S holds 1, the ghost 9
    pool = BlockPool(11, free_queue=policy)
    for i in range(19):  # a scan: S holds keys 9..18, the ghost keys 0..8
        store(pool, policy, key(i))
    assert list(policy._ghost) == [key(i) for i in range(9)]
    pool.allocate(10)  # evicts keys 9..18 from S: 19 ghosts, the oldest one forgotten
    assert list(policy._ghost) == [key(i) for i in range(1, 19)]
    policy.check_invariants()


def test_s3fifo_a_block_stored_anew_starts_without_its_old_frequency_bit() -> None:
    """A block hit in M (bit set) whose keys are dropped while pinned comes back unhashed;
    stored again under a new key it starts in S with its bit clear."""
    policy = S3FIFOPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    block_id = store(pool, policy, key(0))
    hit(pool, key(0))  # hit in S: freed to M
    pool.touch([block_id])  # hit in M: the frequency bit is set
    pool.discard_keys(block_id)  # its KV is no longer trusted
    pool.free([block_id])  # unhashed: reused first
    assert store(pool, policy, key(1)) == block_id
    assert not policy._freq[block_id]
    policy.check_invariants()


def test_s3fifo_a_pin_in_main_gives_no_rounds_while_the_victim_comes_from_s() -> None:
    """Pinning a block of M gives M's head blocks their second-chance round only when
    `pop_victim` would take from M; with S at its share their frequency bits stay."""
    policy = S3FIFOPolicy(11)  # 10 usable blocks: S holds 1
    pool = BlockPool(11, free_queue=policy)
    blocks = [store(pool, policy, key(i)) for i in range(4)]
    for _ in range(2):  # hit in S: to M; hit in M: the frequency bit is set
        for i in range(4):
            hit(pool, key(i))
    assert all(policy._freq[b] for b in blocks)
    store(pool, policy, key(10))  # S = [key 10]: at its share, the next victim
    pool.pin([blocks[3]])
    assert [policy._freq[b] for b in blocks[:3]] == [1, 1, 1]
    policy.check_invariants()


def test_duel_keeps_lru_order_after_a_window_without_hits() -> None:
    """A scan of distinct keys gives both shadows 0 hits: no lead, so no switch."""
    policy = DuelingPolicy(9)  # 8 usable blocks: shadows of 8 keys, decided every 8 accesses
    pool = BlockPool(9, free_queue=policy)
    for i in range(20):
        store(pool, policy, key(i))
    assert not policy.lfu_order
    policy.check_invariants()
