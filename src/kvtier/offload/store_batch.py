"""GPU blocks being copied down to tier slots, as index-parallel lists.

A step stores thousands of blocks; one Python object per block cost more than the rest
of its selection. A `StoreBatch` keeps the i-th store as `gpu_block_ids[i]` copied to
`tier_block_ids[i]` under `keys[i]`, with the rare extras in sparse maps by index.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.core.events import BlockStored
from kvtier.core.keys import Key
from kvtier.core.token_tags import Tag
from kvtier.offload.protocols import LoRAInfo


@dataclass(slots=True)
class StoreBatch:
    """Stores selected together (one step's queue) or issued together (one event).

    `tails` maps an index to the token count of a fine-grained partial tail: that store
    registers its `keys` entry instead of the GPU block's own keys. `payloads` maps an
    index to the `BlockStored` payload captured at selection time (events on, eager);
    `secondary_payloads` those of the GPU block's secondary keys the request's hashes
    name (one per key found, any order). `loras` maps an index without a payload (lazy
    store, hand-off) to the LoRA adapter of the request whose block it copies, and
    `extra_keys` to that block's extra keys where known (() for none). `counts`
    maps an index whose key covered part of its GPU block only when selected (not a
    tail) to that key's token count, for a block that loses its keys meanwhile.
    `tags` maps an index to the token tag of the copied KV (the token check on), for
    stores whose GPU key is the hash the tag was computed for.
    """

    gpu_block_ids: list[int] = field(default_factory=list)
    tier_block_ids: list[int] = field(default_factory=list)
    keys: list[Key] = field(default_factory=list)
    tails: dict[int, int] = field(default_factory=dict)
    payloads: dict[int, BlockStored] = field(default_factory=dict)
    secondary_payloads: dict[int, tuple[BlockStored, ...]] = field(default_factory=dict)
    tags: dict[int, Tag] = field(default_factory=dict)
    loras: dict[int, LoRAInfo] = field(default_factory=dict)
    extra_keys: dict[int, tuple[object, ...]] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    def add(
        self,
        gpu_block_id: int,
        tier_block_id: int,
        key: Key,
        tail_num_tokens: int = 0,
        payload: BlockStored | None = None,
        tag: Tag | None = None,
    ) -> None:
        """Append one store."""
        index = len(self.keys)
        self.gpu_block_ids.append(gpu_block_id)
        self.tier_block_ids.append(tier_block_id)
        self.keys.append(key)
        if tail_num_tokens:
            self.tails[index] = tail_num_tokens
        if payload is not None:
            self.payloads[index] = payload
        if tag is not None:
            self.tags[index] = tag

    def extend(
        self,
        gpu_block_ids: Iterable[int],
        tier_block_ids: Iterable[int],
        keys: Iterable[Key],
        tags: dict[int, Tag] | None = None,
    ) -> None:
        """Append plain stores (no partial tail, no payload), index-parallel; `tags` maps
        an index among the appended stores to its tag."""
        if tags:
            first = len(self.keys)
            self.tags.update((first + i, tag) for i, tag in tags.items())
        self.gpu_block_ids.extend(gpu_block_ids)
        self.tier_block_ids.extend(tier_block_ids)
        self.keys.extend(keys)

    def take(self, gpu_block_ids: set[int]) -> StoreBatch:
        """Remove the stores of `gpu_block_ids` and return them; each store keeps its
        extras, and the rest their order."""
        kept, taken = StoreBatch(), StoreBatch()
        for i, gpu_block_id in enumerate(self.gpu_block_ids):
            batch = taken if gpu_block_id in gpu_block_ids else kept
            index = len(batch.keys)
            batch.add(
                gpu_block_id,
                self.tier_block_ids[i],
                self.keys[i],
                self.tails.get(i, 0),
                self.payloads.get(i),
                self.tags.get(i),
            )
            if i in self.secondary_payloads:
                batch.secondary_payloads[index] = self.secondary_payloads[i]
            if i in self.loras:
                batch.loras[index] = self.loras[i]
            if i in self.extra_keys:
                batch.extra_keys[index] = self.extra_keys[i]
            if i in self.counts:
                batch.counts[index] = self.counts[i]
        self.gpu_block_ids, self.tier_block_ids, self.keys = (
            kept.gpu_block_ids,
            kept.tier_block_ids,
            kept.keys,
        )
        self.tails, self.payloads, self.tags = kept.tails, kept.payloads, kept.tags
        self.secondary_payloads, self.loras = kept.secondary_payloads, kept.loras
        self.counts, self.extra_keys = kept.counts, kept.extra_keys
        return taken
