"""KV cache events, queued by their owner and drained with `take_events()`.

Field names follow vLLM's KV events where they overlap, so KV-aware routers can consume
them after a thin translation. One event describes one key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.core.keys import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """A key became visible in a tier.

    `block_size` is the number of tokens the event spans: a whole block's, or for a
    partial key (a fine-grained tail, a secondary key) its last hash block's, as vLLM's
    events have it (the tier's own count is the pool's `num_tokens`). Lazy stores and
    hand-offs carry no payload: no `token_ids`, parent or `session_id` (the engine's
    session of the request whose block was stored), but the LoRA adapter of that request
    (`lora_id`, `lora_name`) and, where known, its extra keys; nor do secondary keys the
    storing request's hashes do not name, nor cascade demotions of keys whose CPU event
    had none (a demotion reuses its key's CPU payload). `extra_keys` None: unknown (an
    event made without the request's block); `()`: the block has none.
    """

    block_hash: BlockHash
    group_id: int
    block_size: int
    parent_block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    medium: str | None = None
    group_kind: str | None = None
    sliding_window: int | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """A key stopped being visible in a tier (its block was evicted or reused)."""

    block_hash: BlockHash
    group_id: int
    medium: str | None = None


@dataclass(frozen=True)
class AllCleared:
    """Every key of a tier was dropped (reset).

    `removed` names each key the tier held, as the `BlockRemoved` it amounts to, once
    per block that held it (as many as the `BlockStored` events it matches; filled
    by `BlockPool.reset`; not compared): a consumer whose clear event carries no medium,
    such as vLLM's `AllBlocksCleared`, publishes those instead of clearing every tier.
    """

    medium: str | None = None
    removed: tuple[BlockRemoved, ...] = field(default=(), compare=False, repr=False)


KVEvent = BlockStored | BlockRemoved | AllCleared
