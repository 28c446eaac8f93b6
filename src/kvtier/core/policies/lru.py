"""`lru`: the default eviction order, with the policy hooks (no-ops)."""

from __future__ import annotations

from kvtier.core.free_queue import LRUFreeQueue


class LRUPolicy(LRUFreeQueue):
    """`LRUFreeQueue` unchanged: evict the least recently freed cached block.

    Cost: O(1) per operation, 8 bytes per block (the queue's links).
    """

    __slots__ = ()
    name = "lru"
    # `note_key` is `LRUFreeQueue`'s no-op, which `BlockPool.insert_keys` skips calling.
