"""Helpers for the kvtier.core.longest_hit tests (SPEC §5).

Hashes are arbitrary distinct bytes and the cache is a dict `{key: block_id}`: the
function only needs distinct chained-hash-like values and a `cached_block` callable.
Block ids encode where they were registered — `bid(group_id, hash_index)` — so every
expected `block_ids` entry can be read straight off the test.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import BlockHash, Key, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.core.longest_hit import HitGranularity, LongestHit, find_longest_hit

FULL = GroupKind.FULL_ATTENTION
SLIDING = GroupKind.SLIDING_WINDOW
STATE = GroupKind.STATE
SCRATCH = GroupKind.SCRATCH
FINE = HitGranularity.HASH_BLOCK
COARSE = HitGranularity.SCHEDULER_BLOCK
NO_CAP = 10**9
N = NULL_BLOCK_ID

Index = dict[Key, int]


def make_hashes(n: int) -> list[BlockHash]:
    return [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n)]


def group(kind: GroupKind, block_size: int = 16, window: int | None = None) -> KVGroupSpec:
    return KVGroupSpec(kind, block_size, 64, window)


def layout(*groups: KVGroupSpec, hash_block_size: int | None = None) -> KVLayout:
    return KVLayout(tuple(groups), hash_block_size)


def bid(group_id: int, hash_index: int) -> int:
    """Return the block id the tests register for `hash_index` in `group_id` (never null)."""
    return 1 + 1000 * group_id + hash_index


def cache(index: Index, hashes: Sequence[BlockHash], group_id: int, indices: Iterable[int]) -> None:
    """Register the keys of the given hash indices in `group_id`."""
    for i in indices:
        index[make_key(hashes[i], group_id)] = bid(group_id, i)


def cache_blocks(
    index: Index, hashes: Sequence[BlockHash], lay: KVLayout, group_id: int, blocks: Iterable[int]
) -> None:
    """Register whole blocks of `group_id`: block j under hash index (j+1)*k - 1."""
    k = lay.blocks_per_hash(group_id)
    cache(index, hashes, group_id, [(j + 1) * k - 1 for j in blocks])


def hit(
    lay: KVLayout,
    hashes: Sequence[BlockHash],
    index: Index,
    max_num_tokens: int = NO_CAP,
    granularity: HitGranularity = COARSE,
    eagle_proof: bool = False,
) -> LongestHit:
    return find_longest_hit(
        lay, hashes, max_num_tokens, index.get, granularity, eagle_proof=eagle_proof
    )
