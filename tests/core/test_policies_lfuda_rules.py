"""LFU-DA rules a mutation run found untested (each test fails when its rule is
changed): the sketch's aging period counts usable blocks, and a new key noted for a
block whose keys were dropped while in use is counted (not the old one)."""

from __future__ import annotations

from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import LFUDAPolicy


def test_lfuda_sketch_ages_every_ten_accesses_per_usable_block() -> None:
    """3 blocks, 2 usable: the counts halve at the 20th access (stores and hits)."""
    policy = LFUDAPolicy(3)
    pool = BlockPool(3, free_queue=policy)
    store(pool, policy, key(0))
    hit(pool, key(0))  # 2 accesses: key 0 counted twice
    for i in range(1, 18):  # accesses 3..19
        store(pool, policy, key(i))
    assert policy._sketch.estimate(key(0)) == 2
    store(pool, policy, key(18))  # the 20th access: every count halves
    assert policy._sketch.estimate(key(0)) == 1
    policy.check_invariants()


def test_lfuda_counts_a_new_key_stored_into_a_block_whose_keys_were_dropped_in_use() -> None:
    """A block's keys dropped while it is in use (its KV not trusted), then recomputed
    and stored under another key: the new key is counted, and a hit counts it again."""
    policy = LFUDAPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    block_id = store(pool, policy, key(0))
    pool.touch([block_id])
    pool.discard_keys(block_id)
    pool.insert_key(key(1), block_id, 16)
    policy.note_key(block_id, key(1))
    pool.free([block_id])
    assert policy._sketch.estimate(key(1)) == 1
    hit(pool, key(1))
    assert (policy._sketch.estimate(key(0)), policy._sketch.estimate(key(1))) == (2, 2)
    policy.check_invariants()
