"""Helpers for the policy tests: keys, and storing and hitting a block as a tier does."""

from __future__ import annotations

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.policies import EvictionPolicy


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
