"""What a lower-tier slot holds once a copy into it completed: keys, token counts, events.

`Registrar` turns a completed store into the tier pool's keys (the GPU block's primary
and secondary keys, or a fine-grained partial tail) with their `BlockStored` events,
names what a persistent disk slot will hold (`SlotRecord`s, carried by the plan), and
re-indexes the slots a persistent tier kept from an earlier run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import cast

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, key_block_hash, key_group_id
from kvtier.core.kv_groups import KVLayout
from kvtier.offload.plan import SlotRecord, Tier
from kvtier.offload.protocols import GpuPoolView
from kvtier.offload.store_selection import StoreItem

logger = logging.getLogger(__name__)


class Registrar:
    """Register completed stores into `tier_pool` (the tier GPU blocks are stored into)."""

    def __init__(self, layout: KVLayout, tier: Tier, tier_pool: BlockPool, events: bool) -> None:
        self.layout = layout
        self.tier = tier
        self.tier_pool = tier_pool
        self.events = events

    def register(self, item: StoreItem, gpu_pool: GpuPoolView) -> None:
        """Make the item's tier slot hold what its GPU block held."""
        tier_pool = self.tier_pool
        tier_block = item.tier_block_id
        if item.is_partial_tail:
            event = self.event(item.key, item.tail_num_tokens)
            tier_pool.insert_key(item.key, tier_block, item.tail_num_tokens, event)
            return
        gpu_block_id = item.gpu_block_id
        key = gpu_pool.key(gpu_block_id)
        if key is None:
            key = item.key
        num_tokens = gpu_pool.num_tokens(gpu_block_id) or self.block_size(key)
        if not self.events:
            tier_pool.insert_key(key, tier_block, num_tokens)
            for secondary in gpu_pool.secondary_keys(gpu_block_id):
                tier_pool.insert_key(secondary, tier_block, num_tokens)
            return
        stored = item.stored
        if stored is not None and stored.block_hash == key_block_hash(key):
            event = replace(stored, medium=self.tier.value)
        else:
            event = self.event(key, num_tokens)
        tier_pool.insert_key(key, tier_block, num_tokens, event)
        for secondary in gpu_pool.secondary_keys(gpu_block_id):
            tier_pool.insert_key(
                secondary, tier_block, num_tokens, self.event(secondary, num_tokens)
            )

    def register_all(self, items: Sequence[StoreItem], gpu_pool: GpuPoolView) -> None:
        """`register` each item; with events off, with batched reads (a step's hot path)."""
        if self.events:
            for item in items:
                self.register(item, gpu_pool)
            return
        gpu_ids = [item.gpu_block_id for item in items]
        keys: list[Key | None] = gpu_pool.keys(gpu_ids)
        num_tokens = gpu_pool.token_counts(gpu_ids)
        tails = [i for i, item in enumerate(items) if item.tail_num_tokens]
        for i in tails:  # a partial tail registers its own key and token count
            keys[i] = items[i].key
            num_tokens[i] = items[i].tail_num_tokens
        if None in keys or 0 in num_tokens:  # a pinned block lost its key (vLLM moved it)
            for i, item in enumerate(items):
                key = keys[i]
                if key is None:
                    keys[i] = key = item.key
                if not num_tokens[i]:
                    num_tokens[i] = self.block_size(key)
        tier_ids = [item.tier_block_id for item in items]
        self.tier_pool.insert_keys(cast("list[Key]", keys), tier_ids, num_tokens)
        extra = gpu_pool.secondary_keys_of(gpu_ids)
        if extra:
            for item, count in zip(items, num_tokens, strict=True):
                if not item.tail_num_tokens:
                    for secondary in extra.get(item.gpu_block_id, ()):
                        self.tier_pool.insert_key(secondary, item.tier_block_id, count)

    def event(self, key: Key, num_tokens: int, tier: Tier | None = None) -> BlockStored:
        """Return the payload-free `BlockStored` of `key`, with its group's kind and window."""
        group_id = key_group_id(key)
        group = self.layout.groups[group_id]
        return BlockStored(
            key_block_hash(key),
            group_id,
            num_tokens,
            medium=(tier or self.tier).value,
            group_kind=group.kind.value,
            sliding_window=group.sliding_window,
        )

    def block_size(self, key: Key) -> int:
        """Return the block size of the group `key` belongs to."""
        return self.layout.groups[key_group_id(key)].block_size

    def records(self, stores: Sequence[StoreItem], gpu_pool: GpuPoolView) -> tuple[SlotRecord, ...]:
        """Return what each store's slot will hold, for a persistent disk tier's manifest."""
        records = []
        for item in stores:
            num_tokens = item.tail_num_tokens or gpu_pool.num_tokens(item.gpu_block_id)
            records.append(SlotRecord(item.key, num_tokens or self.block_size(item.key)))
        return tuple(records)

    def restore(self, tier: Tier, pool: BlockPool, slots: Iterable[tuple[int, SlotRecord]]) -> int:
        """Index what a persistent tier kept; return the blocks indexed.

        A slot out of range or already indexed, or a key of a group that is not cached,
        is skipped with a warning.
        """
        groups = self.layout.groups
        num_restored = 0
        for slot, record in slots:
            group_id = key_group_id(record.key)
            valid_group = group_id < len(groups) and groups[group_id].is_cacheable
            if not 0 < slot < pool.num_blocks or not valid_group or pool.is_cached(slot):
                logger.warning("%s slot %d: cannot restore %r; skipped", tier.value, slot, record)
                continue
            pool.touch([slot])
            event = self.event(record.key, record.num_tokens, tier)
            pool.insert_key(record.key, slot, record.num_tokens, event)
            pool.free([slot])
            num_restored += 1
        return num_restored
