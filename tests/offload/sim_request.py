"""Requests and the content model for driving the offload scheduler in tests.

- `SimRequest`: a mutable request view (SPEC §2.1) whose block hashes grow with its tokens.
- Content model: a block's content is the key of the last whole hash block its KV holds
  (`block_content`); the fake worker copies these values as the bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.block_pool import BlockPool
from kvtier.core.hashing import NO_EXTRAS, BlockHasher, RequestExtras, RequestHasher
from kvtier.core.keys import BlockHash, Key, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import OffloadConfig
from kvtier.offload.protocols import LoRAInfo
from kvtier.offload.stats import StepCounters
from kvtier.offload.store_selection import StoreSelector

BYTES_PER_BLOCK = 64


# ---------------------------------------------------------------------------- layouts


def full_layout(block_size: int = 4, hash_block_size: int | None = None) -> KVLayout:
    """Return a layout of one full-attention group."""
    group = KVGroupSpec(GroupKind.FULL_ATTENTION, block_size, BYTES_PER_BLOCK)
    return KVLayout((group,), hash_block_size)


def store_selector(gpu: BlockPool, tier: BlockPool) -> StoreSelector:
    """Return a selector of one 4-token full-attention group from `gpu` into `tier`."""
    return StoreSelector(
        full_layout(block_size=4),
        gpu,
        tier,
        StepCounters(),
        record_payload=False,
        fine_grained=False,
    )


def pool_states(selector: StoreSelector) -> list[tuple[list[Any], list[int], list[int]]]:
    """Check both pools' invariants; return each one's keys, reference counts and free
    order (what a selection may change in them)."""
    states = []
    for pool in (selector.gpu_pool, selector.tier_pool):
        assert isinstance(pool, BlockPool)
        pool.check_invariants()
        states.append((list(pool._keys), list(pool._refs), list(pool._free.iter_after(None))))
    return states


def config(**kwargs: object) -> OffloadConfig:
    """Return a CPU-tier config (1 MiB); tests size the tier with `num_tier_blocks`."""
    return OffloadConfig(cpu_bytes=1 << 20, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- requests


@dataclass(slots=True)
class SimRequest:
    """A request view (SPEC §2.1): prompt + outputs so far, and outputs still to come."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    hasher: RequestHasher = field(repr=False)
    future_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    lora: LoRAInfo | None = None
    skip_prefix_cache: bool = False
    session_id: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        return self.hasher.block_hashes

    def block_extra_keys(self, start: int, end: int) -> tuple[object, ...]:
        return self.hasher.block_extra_keys(start, end)

    def blocks_extra_keys(self, block_size: int, count: int) -> list[tuple[object, ...]]:
        size = block_size
        return [self.block_extra_keys(i * size, (i + 1) * size) for i in range(count)]

    @property
    def is_done(self) -> bool:
        """Return True when no output is left to sample and the rest is computed.

        The last sampled output is never computed (nothing reads its KV).
        """
        sampled = self.num_tokens > self.num_prompt_tokens
        return not self.future_token_ids and self.num_computed_tokens == self.num_tokens - sampled

    def append_output(self) -> None:
        """Sample the next output token (predetermined)."""
        token = self.future_token_ids.pop(0)
        self.token_ids.append(token)
        self.hasher.extend([token])


def make_request(
    request_id: str,
    token_ids: Iterable[int],
    hash_block_size: int = 4,
    *,
    outputs: Iterable[int] = (),
    lora: LoRAInfo | None = None,
    extras: RequestExtras = NO_EXTRAS,
    skip_prefix_cache: bool = False,
) -> SimRequest:
    """Return a request whose prompt is `token_ids`; `outputs` are sampled one per step.

    Its hashes take `extras` (multimodal items, cache salt...), with `lora`'s name.
    """
    tokens = list(token_ids)
    extras = dataclasses.replace(extras, lora_name=None if lora is None else lora.lora_name)
    hasher = RequestHasher(BlockHasher(hash_block_size), extras)
    hasher.extend(tokens)
    return SimRequest(
        request_id,
        tokens,
        len(tokens),
        hasher,
        list(outputs),
        lora=lora,
        skip_prefix_cache=skip_prefix_cache,
    )


def block_key(layout: KVLayout, request: SimRequest, group_id: int, pos: int) -> Key:
    """Return the key of whole block `pos` of a group of the request."""
    index = (pos + 1) * layout.blocks_per_hash(group_id) - 1
    return make_key(request.block_hashes[index], group_id)


def content_index(layout: KVLayout, group_id: int, pos: int, num_tokens: int) -> int | None:
    """Return the last whole hash block in block `pos` once `num_tokens` are computed."""
    filled = min(
        layout.groups[group_id].block_size, num_tokens - pos * layout.groups[group_id].block_size
    )
    num_hash_blocks = filled // layout.hash_block_size
    if num_hash_blocks <= 0:
        return None
    return pos * layout.blocks_per_hash(group_id) + num_hash_blocks - 1


def block_content(
    layout: KVLayout, request: SimRequest, group_id: int, pos: int, num_tokens: int
) -> Key | None:
    """Return what block `pos` holds once `num_tokens` tokens are computed.

    That is the key of the last whole hash block in it, or None below one hash block.
    """
    index = content_index(layout, group_id, pos, num_tokens)
    return None if index is None else make_key(request.block_hashes[index], group_id)


def needed_positions(group: KVGroupSpec, num_tokens: int) -> range:
    """Return the block positions a group reads to continue after `num_tokens` tokens."""
    end = math.ceil(num_tokens / group.block_size)
    if group.kind is GroupKind.FULL_ATTENTION:
        return range(end)
    if group.kind is GroupKind.SLIDING_WINDOW:
        whole = num_tokens // group.block_size
        return range(max(0, whole - group.num_window_blocks), end)
    if group.kind is GroupKind.STATE and num_tokens % group.block_size == 0 and end > 0:
        return range(end - 1, end)
    return range(0)
