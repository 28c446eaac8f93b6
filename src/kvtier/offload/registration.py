"""What a lower-tier slot holds once a copy into it completed: keys, token counts, events.

`Registrar` turns a completed store into the tier pool's keys (the GPU block's primary
and secondary keys, or a fine-grained partial tail) with their `BlockStored` events,
names what a persistent disk slot will hold (`SlotRecord`s, carried by the plan), and
re-indexes the slots a persistent tier kept from an earlier run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import cast

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, key_block_hash, key_group_id, make_key
from kvtier.core.kv_groups import KVLayout, tokens_inside_block
from kvtier.offload.plan import SlotRecord, Tier
from kvtier.offload.protocols import GpuPoolView, LoRAInfo
from kvtier.offload.store_batch import StoreBatch

logger = logging.getLogger(__name__)


class Registrar:
    """Register completed stores into `tier_pool` (the tier GPU blocks are stored into)."""

    def __init__(
        self, layout: KVLayout, tier: Tier, tier_pool: BlockPool, events: bool, tags: bool = False
    ) -> None:
        self.layout = layout
        self.tier = tier
        self.tier_pool = tier_pool
        self.events = events
        self.tags = tags  # the token check is on: restored slots keep their tags

    def register(self, stores: StoreBatch, index: int, gpu_pool: GpuPoolView) -> None:
        """Make store `index`'s tier slot hold what its GPU block held.

        Under the key selected, never one the block took since: vLLM keys a block
        further as its request fills it (a partial entry promoted to the full block's
        key), and the copy may predate those tokens. A block keyed otherwise since is
        registered under no key (its slot goes back unkeyed); one that lost its key,
        under the one selected, with the count it had then (`StoreBatch.counts`).
        """
        tier_pool = self.tier_pool
        tier_block = stores.tier_block_ids[index]
        own_key = stores.keys[index]
        tail_num_tokens = stores.tails.get(index, 0)
        tag = stores.tags.get(index)
        lora = stores.loras.get(index)  # a store without payload: its request's adapter
        if tail_num_tokens:
            tail = stores.payloads.get(index)  # captured at selection (events on, eager)
            event = (
                self.event(own_key, tail_num_tokens, lora=lora)
                if tail is None
                else replace(tail, medium=self.tier.value)
            )
            tier_pool.insert_key(own_key, tier_block, tail_num_tokens, event, tag)
            return
        gpu_block_id = stores.gpu_block_ids[index]
        key = gpu_pool.key(gpu_block_id) or own_key
        if key != own_key:
            return
        num_tokens = (  # the key's count, as selected where the block lost its keys
            gpu_pool.num_tokens(gpu_block_id) or stores.counts.get(index) or self.block_size(key)
        )
        if not self.events:
            tier_pool.insert_key(key, tier_block, num_tokens, tag=tag)
            for secondary in gpu_pool.secondary_keys(gpu_block_id):
                tier_pool.insert_key(secondary, tier_block, num_tokens)
            return
        # The payload names the request's block (the same hash may be another group's
        # too, a window's block vLLM dropped and gave to full attention): only the
        # key's own payload describes it.
        stored = stores.payloads.get(index)
        if stored is not None and make_key(stored.block_hash, stored.group_id) == key:
            event = replace(stored, medium=self.tier.value)
        else:  # extra keys noted for the block's own whole key only
            extra_keys = stores.extra_keys.get(index)
            event = self.event(key, num_tokens, lora=lora, extra_keys=extra_keys)
        tier_pool.insert_key(key, tier_block, num_tokens, event, tag)
        found = {  # the secondary keys' payloads captured at selection (eager)
            make_key(p.block_hash, p.group_id): p for p in stores.secondary_payloads.get(index, ())
        }
        for secondary in gpu_pool.secondary_keys(gpu_block_id):
            payload = found.get(secondary)
            event = (
                self.event(secondary, None, lora=lora)
                if payload is None
                else replace(payload, medium=self.tier.value)
            )
            tier_pool.insert_key(secondary, tier_block, num_tokens, event)

    def register_all(self, stores: StoreBatch, gpu_pool: GpuPoolView) -> None:
        """`register` each store; with events off, with batched reads (a step's hot path)."""
        if self.events:
            for index in range(len(stores)):
                self.register(stores, index, gpu_pool)
            return
        gpu_ids = stores.gpu_block_ids
        keys: list[Key | None] = gpu_pool.keys(gpu_ids)
        num_tokens = gpu_pool.token_counts(gpu_ids)
        for i, count in stores.tails.items():  # a partial tail registers its own key
            keys[i] = stores.keys[i]
            num_tokens[i] = count
        own = stores.keys
        if keys != own or 0 in num_tokens:  # rare: a block lost its key, or changed it
            for i, own_key in enumerate(own):
                key = keys[i]
                if key is None:
                    keys[i] = key = own_key
                if not num_tokens[i]:
                    num_tokens[i] = stores.counts.get(i) or self.block_size(key)
            moved = {i for i, key in enumerate(keys) if key != own[i]}
            if moved:
                self._register_some(stores, gpu_pool, moved)
                return
        tier_ids = stores.tier_block_ids
        self.tier_pool.insert_keys(cast("list[Key]", keys), tier_ids, num_tokens, stores.tags)
        extra = gpu_pool.secondary_keys_of(gpu_ids)
        if extra:
            tails = stores.tails
            for i, (gpu_block_id, count) in enumerate(zip(gpu_ids, num_tokens, strict=True)):
                if i not in tails:
                    for secondary in extra.get(gpu_block_id, ()):
                        self.tier_pool.insert_key(secondary, tier_ids[i], count)

    def _register_some(self, stores: StoreBatch, gpu_pool: GpuPoolView, moved: set[int]) -> None:
        """`register` the stores but those in `moved`, whose GPU blocks vLLM keyed further
        since they were selected: their slots go back to the tier unkeyed."""
        logger.debug("%d stores: their GPU blocks were keyed further since", len(moved))
        for index in range(len(stores)):
            if index not in moved:
                self.register(stores, index, gpu_pool)

    def event(
        self,
        key: Key,
        num_tokens: int | None,
        tier: Tier | None = None,
        lora: LoRAInfo | None = None,
        extra_keys: tuple[object, ...] | None = None,
    ) -> BlockStored:
        """Return the payload-free `BlockStored` of `key`, with its group's kind and window
        (and `lora`, the adapter of the request whose block it stored, and the
        `extra_keys` of its whole block, when known: a partial entry's stay unknown).

        `num_tokens`: the tokens of its block `key` covers; None for a secondary key (no
        pool records its count). A key covering less than a whole block (a partial tail,
        a secondary key) is a partial entry, which vLLM's events describe by its last
        hash block: its `block_size` is the hash block size, as vLLM's own event for
        the same hash has it (`BlockPool.cache_partial_block`).
        """
        group_id = key_group_id(key)
        group = self.layout.groups[group_id]
        if num_tokens is None or num_tokens < group.block_size:
            num_tokens = self.layout.hash_block_size
            extra_keys = None
        return BlockStored(
            key_block_hash(key),
            group_id,
            num_tokens,
            medium=(tier or self.tier).value,
            group_kind=group.kind.value,
            sliding_window=group.sliding_window,
            lora_id=None if lora is None else lora.lora_id,
            lora_name=None if lora is None else lora.lora_name,
            extra_keys=extra_keys,
        )

    def block_size(self, key: Key) -> int:
        """Return the block size of the group `key` belongs to."""
        return self.layout.groups[key_group_id(key)].block_size

    def records(self, stores: StoreBatch, gpu_pool: GpuPoolView) -> tuple[SlotRecord, ...]:
        """Return what each store's slot will hold, for a persistent disk tier's manifest."""
        records = []
        tails = stores.tails
        for i, (gpu_block_id, key) in enumerate(
            zip(stores.gpu_block_ids, stores.keys, strict=True)
        ):
            num_tokens = tails.get(i) or gpu_pool.num_tokens(gpu_block_id) or stores.counts.get(i)
            tag = stores.tags.get(i)
            records.append(SlotRecord(key, num_tokens or self.block_size(key), tag))
        return tuple(records)

    def restore(
        self,
        tier: Tier,
        pool: BlockPool,
        slots: Iterable[tuple[int, SlotRecord]],
        dropped: list[int] | None = None,
    ) -> int:
        """Index what a persistent tier kept; return the blocks indexed.

        A slot out of range or already indexed, or a key of a group that is not cached,
        is skipped with a warning. A token count above the group's block size (a vLLM
        prefix count, which older manifests held) becomes the tokens inside the block.

        With the token check on, tagged records are indexed first: a key a run without
        the check kept (no tag) and a later run stored again with its tag is held by
        both slots, and a lookup, which checks the key's first block only, must find the
        tagged one (indexed behind the untagged copy, it was never served, and every run
        demoted the key again). An untagged record of a key restored with a tag is then
        not indexed at all, and its slot is added to `dropped` (its manifest record can
        go): the check never serves it, and no demotion would ever replace it.
        """
        groups = self.layout.groups
        num_restored = num_untagged = 0
        if self.tags:  # stable: slot order within each kind
            slots = sorted(slots, key=lambda pair: pair[1].tag is None)
        tagged: set[Key] = set()
        for slot, record in slots:
            if self.tags and record.tag is None and record.key in tagged:
                if dropped is not None and 0 < slot < pool.num_blocks:
                    dropped.append(slot)
                continue
            group_id = key_group_id(record.key)
            valid_group = group_id < len(groups) and groups[group_id].is_cacheable
            if not 0 < slot < pool.num_blocks or not valid_group or pool.is_cached(slot):
                logger.warning("%s slot %d: cannot restore %r; skipped", tier.value, slot, record)
                continue
            num_tokens = record.num_tokens
            size = groups[group_id].block_size
            if num_tokens > size:  # a vLLM prefix count, as manifests before 33c24ee held
                num_tokens = tokens_inside_block(num_tokens, size)
            pool.touch([slot])
            event = self.event(record.key, num_tokens, tier)
            tag = record.tag if self.tags else None  # unread without the check: not kept
            pool.insert_key(record.key, slot, num_tokens, event, tag)
            pool.free([slot])
            num_restored += 1
            num_untagged += record.tag is None
            if self.tags and record.tag is not None:
                tagged.add(record.key)
        if self.tags and num_untagged:
            logger.warning(
                "%s: %d of %d restored blocks carry no token tag (stored without "
                "token_check); the check never serves them",
                tier.value,
                num_untagged,
                num_restored,
            )
        return num_restored
