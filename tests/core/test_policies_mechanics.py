"""Eviction and admission policies: the mechanics docs/policies.md describes, one by one.

Each test pins down one rule of a policy (how ARC's target `p` moves, which ghost goes,
S-3FIFO's second chance, ...) that the end-to-end hit-ratio checks do not tell apart.
"""

from __future__ import annotations

import hashlib

from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.policies import (
    ARCPolicy,
    DoorkeeperAdmission,
    DuelingPolicy,
    EvictionPolicy,
    S3FIFOPolicy,
)
from kvtier.core.policies.sketch import CountMinSketch


def access(pool: BlockPool, policy: EvictionPolicy, k: Key) -> None:
    """Hit `k` if the pool holds it, else store it."""
    if cached(pool, k):
        hit(pool, k)
    else:
        store(pool, policy, k)


def cached(pool: BlockPool, k: Key) -> bool:
    return pool.cached_block(k) is not None


# ----------------------------------------------------------------- ARC


def arc_with_p_one() -> tuple[ARCPolicy, BlockPool, Key]:
    """Return an ARC pool (4 blocks) whose `p` is 1 and whose B2 holds key 0."""
    policy = ARCPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    for i in range(4):  # four blocks hit once: T2 holds them all
        store(pool, policy, key(i))
        hit(pool, key(i))
    store(pool, policy, key(10))  # T1 is empty: the victim comes from T2 (key 0 -> B2)
    store(pool, policy, key(11))  # T1 holds key 10 > p = 0: key 10 -> B1
    assert not cached(pool, key(0))
    assert not cached(pool, key(10))
    store(pool, policy, key(10))  # a B1 ghost: T1 was too small, p grows
    assert policy.target_t1 == 1.0
    return policy, pool, key(0)


def test_arc_b1_ghost_hit_grows_p_and_the_block_joins_t2() -> None:
    """A key re-stored from B1 goes to T2's MRU end (iterated after T1 and older T2 blocks)."""
    policy, pool, _ = arc_with_p_one()
    block_id = pool.cached_block(key(10))
    order = list(pool.iter_free_after(None))
    assert order[-1] == block_id, "a B1 ghost hit must join T2, not T1"
    policy.check_invariants()


def test_arc_b2_ghost_hit_shrinks_p() -> None:
    """A key re-stored from B2 means T2 was too small: `p` drops (here from 1 to 0)."""
    policy, pool, in_b2 = arc_with_p_one()
    store(pool, policy, in_b2)
    assert policy.target_t1 == 0.0
    policy.check_invariants()


def test_arc_trims_its_ghosts_to_the_pool_size_at_each_store_oldest_first() -> None:
    """After a store the ghost directory holds at most as many keys as usable blocks, and
    the keys it forgot are the oldest evicted ones (the newest ghost still steers `p`).
    B1 is bounded with B2 (B1 + B2 <= c), not by the paper's |T1| + |B1| <= c, which
    would have emptied it here: a deliberate departure (docs/policies.md)."""
    policy = ARCPolicy(5)  # 4 usable blocks
    pool = BlockPool(5, free_queue=policy)
    for i in range(12):  # a scan: keys 0..7 are evicted from T1 into B1
        store(pool, policy, key(i))
        assert len(policy._b1) + len(policy._b2) <= 4, i
    assert list(policy._b1) == [key(4), key(5), key(6), key(7)]
    store(pool, policy, key(7))  # the newest ghost: a B1 hit
    assert policy.target_t1 == 1.0
    store(pool, policy, key(0))  # long forgotten: no ghost hit
    assert policy.target_t1 == 1.0
    policy.check_invariants()


# ----------------------------------------------------------------- S3-FIFO


def test_s3fifo_a_block_hit_in_main_gets_one_more_round() -> None:
    """A block hit while in M has its frequency bit set: at M's head it goes back to the
    tail (bit cleared) instead of being evicted, so a block freed after it goes first."""
    policy = S3FIFOPolicy(7)  # 6 usable blocks, S holds 1
    pool = BlockPool(7, free_queue=policy)
    for i in range(4):  # hit in S: all four move to M, in order
        store(pool, policy, key(i))
        hit(pool, key(i))
    hit(pool, key(0))  # a hit in M: M's tail, frequency bit set
    store(pool, policy, key(4))
    hit(pool, key(4))  # M: keys 1, 2, 3, 0 (bit set), 4
    pool.allocate(5)  # the unhashed block, then M's victims: 1, 2, 3, and 4 (0 gets a round)
    assert [cached(pool, key(i)) for i in range(5)] == [True, False, False, False, False]
    policy.check_invariants()


def test_s3fifo_ghost_holds_as_many_keys_as_main_can_oldest_forgotten() -> None:
    """G remembers S's evictions, at most as many as M can hold (usable blocks - S's
    share), trimmed at each store: the oldest evicted keys are forgotten first."""
    policy = S3FIFOPolicy(11)  # 10 usable blocks: S's share 1, M (and G) 9
    pool = BlockPool(11, free_queue=policy)
    for i in range(30):  # a scan: keys 0..19 are evicted from S
        store(pool, policy, key(i))
        assert len(policy._ghost) <= 9, i
    assert list(policy._ghost) == [key(i) for i in range(11, 20)]
    policy.check_invariants()


def test_s3fifo_small_fifo_is_a_tenth_of_the_pool() -> None:
    """S's share is 10 % of the usable blocks: with 20 blocks, S holding 2 is at its
    share, so a store evicts S's head and not M's."""
    policy = S3FIFOPolicy(21)
    pool = BlockPool(21, free_queue=policy)
    for i in range(18):  # 18 blocks in M
        store(pool, policy, key(i))
        hit(pool, key(i))
    store(pool, policy, key(100))
    store(pool, policy, key(101))  # S: keys 100, 101; the pool is full
    store(pool, policy, key(102))
    assert [cached(pool, key(0)), cached(pool, key(100))] == [True, False]
    policy.check_invariants()


# ----------------------------------------------------------------- door


def test_door_remembers_a_first_sighting_for_two_generations_of_twice_the_pool() -> None:
    """`door`'s Bloom generation is 2 x the usable blocks: with 4 blocks a key offered
    once is still known after 7 other offers (one generation of 8), and forgotten after
    16 (two generations)."""
    admission = DoorkeeperAdmission(5)
    assert not admission.admit(key(1))
    for i in range(100, 107):
        assert not admission.admit(key(i))
    assert admission.admit(key(1)), "forgotten within one generation of 2 x 4 offers"
    admission = DoorkeeperAdmission(5)
    admission.admit(key(1))
    for i in range(100, 116):
        admission.admit(key(i))
    assert not admission.admit(key(1))
    admission.check_invariants()


def test_door_and_the_count_min_sketch_count_two_groups_keys_apart() -> None:
    """A hybrid model stores one key per KV group of a prefix. Regression: the sketches
    hashed a key's first 8 bytes only, so group 1's key found group 0's sighting: `door`
    admitted it on its first offer (half-prefixes, which never hit), and LFU-DA counted
    one store twice."""
    hashes = [hashlib.sha256(b"prefix %d" % i).digest() for i in range(50)]
    admission = DoorkeeperAdmission(1000)
    for block_hash in hashes:
        assert not admission.admit(make_key(block_hash, 0))
        assert not admission.admit(make_key(block_hash, 1))
    assert all(admission.admit(make_key(h, g)) for h in hashes for g in (0, 1))
    sketch = CountMinSketch(1024, aging_period=10_000)
    assert [sketch.add(make_key(hashes[0], g)) for g in (0, 1, 0)] == [1, 1, 2]


# ----------------------------------------------------------------- duel


def test_duel_falls_back_to_lru_when_frequency_stops_paying() -> None:
    """Once in LFU-DA order, the duel returns to LRU order when the LRU shadow leads:
    here short-lived working sets (6 new keys, each used twice) after a hot phase whose
    keys are never used again."""
    policy = DuelingPolicy(9)  # 8 usable blocks
    pool = BlockPool(9, free_queue=policy)
    for r in range(40):  # 4 hot keys, then 5 fresh ones: LFU-DA wins (as in test_policies)
        for k in [key(i) for i in range(4)] + [key(100 + 5 * r + i) for i in range(5)]:
            access(pool, policy, k)
    assert policy.lfu_order
    for phase in range(10):
        working_set = [key(10_000 + 8 * phase + i) for i in range(6)]
        for k in working_set + working_set:
            access(pool, policy, k)
    assert not policy.lfu_order, "the duel never went back to LRU order"
    policy.check_invariants()


def test_duel_shadows_replay_hits_and_halve_their_counts_at_each_decision() -> None:
    """Both shadows see every access of the tier, hits included (not only stores), and
    their hit counts are halved after each decision (every shadow-size accesses)."""
    policy = DuelingPolicy(9)  # 8 usable blocks: no sampling, shadows of 8, a window of 8
    pool = BlockPool(9, free_queue=policy)
    store(pool, policy, key(1))
    for _ in range(6):
        hit(pool, key(1))
    assert (policy._shadow_lru.hits, policy._shadow_lfu.hits) == (6, 6)
    hit(pool, key(1))  # the 8th access: a decision (a tie), then both counts halve
    assert (policy._shadow_lru.hits, policy._shadow_lfu.hits) == (3.5, 3.5)
    policy.check_invariants()


def test_duel_switches_only_on_a_lead_of_more_than_half_a_standard_deviation() -> None:
    """z = 0.5: at a decision the LFU-DA shadow must lead by more than
    0.5 * sqrt(hits_lru + hits_lfu); a lead of 1 in 19 hits is noise, 4 in 22 is not."""
    for lfu_hits, switches in ((10.0, False), (13.0, True)):
        policy = DuelingPolicy(9)  # decisions every 8 accesses
        pool = BlockPool(9, free_queue=policy)
        policy._shadow_lru.hits, policy._shadow_lfu.hits = 9.0, lfu_hits
        for i in range(8):  # fresh keys: no shadow hits, one decision
            store(pool, policy, key(i))
        assert policy.lfu_order is switches, lfu_hits


def test_duel_samples_the_shadows_above_4096_blocks() -> None:
    """A tier of more than 4,096 blocks feeds its shadows one key in `capacity / 4096`
    (here 2), chosen by key hash."""
    policy = DuelingPolicy(8193)
    pool = BlockPool(8193, free_queue=policy)
    for i in range(200):
        store(pool, policy, key(i))
    assert 60 < policy._sampled < 140


def test_duel_samples_a_tier_of_one_block_over_4096() -> None:
    """The sample rate rounds up: 4,097 usable blocks sample one key in 2 (shadows of 2,048),
    not every key into shadows larger than 4,096 (a mutant rounding down passed)."""
    policy = DuelingPolicy(4098)
    pool = BlockPool(4098, free_queue=policy)
    for i in range(200):
        store(pool, policy, key(i))
    assert 60 < policy._sampled < 140
