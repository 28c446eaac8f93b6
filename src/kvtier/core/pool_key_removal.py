"""The key-removing operations of a `BlockPool`: discard, evict, release-and-evict.

`PoolKeyRemoval` is a mixin of `BlockPool`; `block_pool` keeps allocation, references,
key insertion and reset. A block that loses its primary key loses every key it holds;
each removal is recorded as a `BlockRemoved` event when the pool records events.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.core.events import BlockRemoved, BlockStored, KVEvent
from kvtier.core.keys import Key, key_block_hash, key_group_id
from kvtier.core.pool_block import NULL_BLOCK_ID
from kvtier.core.pool_checks import PoolError
from kvtier.core.pool_queries import PoolQueries


class PoolKeyRemoval(PoolQueries):
    """Operations that drop keys from blocks, over the state `BlockPool.__init__` sets up."""

    medium: str | None
    _record_events: bool
    _events: list[KVEvent]
    _payloads: dict[tuple[int, Key], BlockStored] | None

    def discard_keys(self, block_id: int) -> None:
        """Drop every key of `block_id` (its content is no longer trusted).

        A free block moves to the head of the free queue, to be reused first.
        """
        self._check_id(block_id)
        if self._keys[block_id] is None:
            return
        self._drop_keys(block_id)
        if block_id != NULL_BLOCK_ID and self._refs[block_id] == 0:
            self._free.discard(block_id)  # not `remove`, which policies count as a hit
            self._free.push_reusable(block_id)

    def discard_keys_of(self, block_ids: Iterable[int]) -> None:
        """`discard_keys` of each block (blocks whose KV no forward wrote: the offload
        scheduler's `GpuPoolView.discard_keys_of`)."""
        for block_id in block_ids:
            self.discard_keys(block_id)

    def discard_secondary_key(self, block_id: int, key: Key) -> None:
        """Drop `key` from `block_id` where the block holds it as a secondary key; its
        primary key and other secondary keys stay. A no-op when it does not hold it so."""
        self._check_id(block_id)
        secondary = self._secondary.get(block_id)
        if not secondary or key not in secondary:
            return
        secondary.remove(key)
        if not secondary:
            del self._secondary[block_id]
        self._unindex(key, block_id)
        if self._record_events:
            self._events.append(BlockRemoved(key_block_hash(key), key_group_id(key), self.medium))
            if self._payloads:
                self._payloads.pop((block_id, key), None)

    def discard_all_keys(self) -> None:
        """`discard_keys` of every block, referenced ones included: nothing cached so far
        is found again. What `reset` cannot do while blocks are referenced."""
        for block_id in [b for b, key in enumerate(self._keys) if key is not None]:
            self.discard_keys(block_id)

    def evict_keys(self, block_id: int) -> None:
        """Evict free cached block `block_id` now: its keys are dropped (`discard_keys`)
        and its eviction policy records the eviction as it records its own victims
        (ghost keys, aging). The block is queued to be reused first.

        For a block that leaves this tier's index on purpose, e.g. moved down to the
        next tier. Raises PoolError for a referenced block or an id out of range.
        """
        self._check_id(block_id)
        if block_id == NULL_BLOCK_ID or self._keys[block_id] is None:
            return
        if self._refs[block_id]:
            raise PoolError(f"block {block_id} is in use: only a free block can be evicted")
        self._free.evict(block_id)
        self._drop_keys(block_id)
        self._free.push_reusable(block_id)

    def release_evicted(self, block_id: int) -> None:
        """Drop the last reference of `block_id`, a `pin`, and evict the block at once.

        As `evict_keys`, with the eviction recorded from where the block was when it was
        pinned (a write-back demotion pins its next victims, copies them down, then
        evicts them). Raises PoolError unless the block is cached with one reference.
        """
        self._check_id(block_id)
        if block_id == NULL_BLOCK_ID or self._keys[block_id] is None:
            raise PoolError(f"block {block_id} holds no key: nothing to evict")
        if self._refs[block_id] != 1:
            raise PoolError(
                f"block {block_id} has {self._refs[block_id]} references; "
                "release_evicted drops the last one"
            )
        self._refs[block_id] = 0
        self._free.evict_taken(block_id)
        self._drop_keys(block_id)
        self._free.push_reusable(block_id)

    # ----------------------------------------------------------------- internals

    def _drop_keys(self, block_id: int) -> None:
        primary = self._keys[block_id]
        assert primary is not None
        self._keys[block_id] = None
        self._num_tokens[block_id] = 0
        if self._tags:
            self._tags.pop(block_id, None)
        secondary = self._secondary.pop(block_id, None) if self._secondary else None
        if secondary is None and not self._record_events and primary not in self._more_blocks:
            del self._index[primary]  # the common case: one key, held by this block only
            return
        for key in [primary, *(secondary or ())]:
            self._unindex(key, block_id)
            if self._record_events:
                removed = BlockRemoved(key_block_hash(key), key_group_id(key), self.medium)
                self._events.append(removed)
                if self._payloads:
                    self._payloads.pop((block_id, key), None)

    def _unindex(self, key: Key, block_id: int) -> None:
        more = self._more_blocks.get(key)
        if self._index[key] == block_id:
            if more:
                self._index[key] = more.pop()
            else:
                del self._index[key]
        else:
            assert more is not None
            more.remove(block_id)
        if more is not None and not more:
            del self._more_blocks[key]
