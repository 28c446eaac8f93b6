"""Helpers for the policy tests: keys, and storing and hitting a block as a tier does."""

from __future__ import annotations

import random

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.policies import EVICTION_POLICIES, EvictionPolicy


def key(i: int) -> Key:
    return make_key(i.to_bytes(8, "little"), 0)


def store(pool: BlockPool, policy: EvictionPolicy, k: Key) -> int:
    """Store `k` the way a tier does: allocate, register, note, free."""
    (block_id,) = pool.allocate(1)
    pool.insert_key(k, block_id, 16)
    policy.note_key(block_id, k)
    pool.free([block_id])
    return block_id


def hit(pool: BlockPool, k: Key) -> None:
    """Touch and free the block holding `k`, as a lookup that hits and loads it does."""
    block_id = pool.cached_block(k)
    assert block_id is not None, "expected a hit"
    pool.touch([block_id])
    pool.free([block_id])


def random_pool(name: str, seed: int) -> tuple[BlockPool, EvictionPolicy]:
    """A pool and its policy after random stores, hits, pins and frees (some blocks left
    pinned)."""
    rng = random.Random(seed)
    num_blocks = rng.randrange(4, 24)
    policy = EVICTION_POLICIES[name](num_blocks)
    pool = BlockPool(num_blocks, free_queue=policy)
    pinned: list[int] = []
    for _ in range(rng.randrange(1, 120)):
        k = key(rng.randrange(3 * num_blocks))
        block_id = pool.cached_block(k)
        if block_id is not None:  # a hit: pinned, then released (or kept a while)
            pool.touch([block_id])
            pinned.append(block_id)
        elif pool.num_free():
            (block_id,) = pool.allocate(1)
            if rng.random() < 0.9:  # a store; else an unhashed block (a failed copy)
                pool.insert_key(k, block_id, 16)
                policy.note_key(block_id, k)
            pinned.append(block_id)
        if pinned and (rng.random() < 0.7 or not pool.num_free()):
            pool.free([pinned.pop(rng.randrange(len(pinned)))])
    pool.check_invariants()
    return pool, policy
