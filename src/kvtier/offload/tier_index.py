"""The lower tiers' pools as one id space, for lookups and lookup pins.

A lookup hit may span tiers (CPU blocks, then disk blocks, in any mix). `find_longest_hit`
sees one id per block: ids of the first tier are its block ids, ids of the second are
offset by the first pool's size. The null block stays 0. With one tier every method is
the pool's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.keys import Key
from kvtier.offload.plan import Tier


class TierIndex:
    """One or two lower-tier pools, fastest first, behind one id space.

    `cached_block(key)`, `touch(ids)` and `free(ids)` take ids in the shared space.
    """

    def __init__(self, pools: Sequence[tuple[Tier, BlockPool]]) -> None:
        if not 1 <= len(pools) <= 2:
            raise ValueError(f"one or two lower tiers, got {len(pools)}")
        self.tiers = tuple(tier for tier, _ in pools)
        self.pools = dict(pools)
        self.first = pools[0][1]
        self._offset = self.first.num_blocks
        self._second = pools[1][1] if len(pools) == 2 else None
        # With one tier these are the pool's own: no extra call per key, and a lookup
        # is its live key index's `get` (`BlockPool.cached_block` without its call).
        self.cached_block: Callable[[Key], int | None] = self.first.index.get
        self.touch: Callable[[Iterable[int]], None] = self.first.touch
        self.free: Callable[[Iterable[int]], None] = self.first.free
        if self._second is not None:
            self.cached_block = self._cached_across
            self.touch = self._touch_split
            self.free = self._free_split

    def _cached_across(self, key: Key) -> int | None:
        """Return the id of a block holding `key` in the fastest tier that has it."""
        block_id = self.first.cached_block(key)
        if block_id is not None:
            return block_id
        assert self._second is not None
        block_id = self._second.cached_block(key)
        return None if block_id is None else block_id + self._offset

    def tag(self, block_id: int, key: Key | None = None) -> bytes | None:
        """Return the token tag of a block (an id in the shared space), or None; with
        `key`, only if `key` is the block's primary key."""
        if self._second is not None and block_id >= self._offset:
            return self._second.tag(block_id - self._offset, key)
        return self.first.tag(block_id, key)

    def _touch_split(self, ids: Iterable[int]) -> None:
        """Pin each block (ids in the shared space)."""
        for tier, local in self.split(ids):
            self.pools[tier].touch(local)

    def _free_split(self, ids: Iterable[int]) -> None:
        """Unpin each block (ids in the shared space), in order per tier."""
        for tier, local in self.split(ids):
            self.pools[tier].free(local)

    def split_pairs(
        self, ids: Sequence[int], gpu_ids: Sequence[int]
    ) -> list[tuple[Tier, list[int], list[int]]]:
        """Split (shared id, GPU id) pairs by tier: (tier, tier block ids, GPU ids)."""
        if self._second is None:
            return [(self.tiers[0], list(ids), list(gpu_ids))]
        parts: dict[Tier, tuple[list[int], list[int]]] = {}
        offset = self._offset
        for block_id, gpu_id in zip(ids, gpu_ids, strict=True):
            tier = self.tiers[block_id >= offset]
            local, gpus = parts.setdefault(tier, ([], []))
            local.append(block_id - offset if block_id >= offset else block_id)
            gpus.append(gpu_id)
        return [(tier, *parts[tier]) for tier in self.tiers if tier in parts]

    def split(self, ids: Iterable[int]) -> list[tuple[Tier, list[int]]]:
        """Split shared ids by tier into each tier's block ids (with two tiers, the null
        block dropped; with one, `ids` as they are: the pool skips the null block)."""
        if self._second is None:
            return [(self.tiers[0], list(ids))]
        first: list[int] = []
        second: list[int] = []
        offset = self._offset
        for block_id in ids:
            if block_id >= offset:
                second.append(block_id - offset)
            elif block_id != NULL_BLOCK_ID:
                first.append(block_id)
        return [(self.tiers[0], first), (self.tiers[1], second)]
