"""Helpers shared by the block pool tests: pools, keys and cached runs."""

from __future__ import annotations

import hashlib

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockRemoved
from kvtier.core.keys import Key, key_block_hash, make_key


def make_pool(num_blocks: int = 8, events: bool = False, medium: str | None = None) -> BlockPool:
    return BlockPool(num_blocks, medium=medium, record_events=events)


def make_test_key(i: int, group_id: int = 0) -> Key:
    return make_key(hashlib.sha256(str(i).encode()).digest(), group_id)


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.iter_free_after(None))


def cache_blocks(pool: BlockPool, keys: list[Key]) -> list[int]:
    """Allocate one block per key, give it the key, and free them tail-first."""
    block_ids = pool.allocate(len(keys))
    for key, block_id in zip(keys, block_ids, strict=True):
        pool.insert_key(key, block_id, 16)
    pool.free(reversed(block_ids))
    return block_ids


def removed(key: Key, group_id: int = 0, medium: str | None = None) -> BlockRemoved:
    return BlockRemoved(key_block_hash(key), group_id, medium)
