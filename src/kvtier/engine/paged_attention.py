"""Paged KV cache: write new K/V into slots, attend through block tables.

Layout of one layer's cache (the offload worker registers these tensors as they are):

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]    kv_cache[0] = K, [1] = V

Slot `s` is token offset `s % block_size` of block `s // block_size`. Block 0 is the null
block: a placeholder for positions a sliding-window group no longer keeps; nothing
meaningful is ever written there and attention never reads it.

One sequence in a step has `num_cached_tokens` already in the cache and `num_new_tokens`
query tokens right after them. Prefill, prefill of an uncached suffix, chunked prefill and
decode (one new token) are all this one case. Which keys a query at position p sees:

    key position k:   0 ........ p-window | p-window+1 ........ p | p+1 ...
    full attention:   attends ..................................... | masked
    sliding window:   masked (may be null) | attends ............... | masked
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional

KV_DIM_KEY = 0
KV_DIM_VALUE = 1


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """Return the shape of one layer's KV cache tensor."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one step's tokens sit in one KV group's paged cache.

    The step's tokens are laid out sequence after sequence. Sequence i has
    `num_new_tokens[i]` tokens at positions `num_cached_tokens[i]` onwards; its block
    table is row i of `block_tables` ([num_seqs, max_blocks] int64, padded with the null
    block). `slot_mapping` ([num_tokens] int64) is the slot of each new token. Tensors live
    on the cache's device.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    num_cached_tokens: tuple[int, ...]
    num_new_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.num_cached_tokens) != len(self.num_new_tokens):
            raise ValueError(
                f"{len(self.num_cached_tokens)} cached counts for "
                f"{len(self.num_new_tokens)} new counts"
            )
        num_seqs = len(self.num_new_tokens)
        if self.block_tables.shape[0] != num_seqs:
            raise ValueError(f"{self.block_tables.shape[0]} block tables for {num_seqs} sequences")
        if self.slot_mapping.shape[0] != sum(self.num_new_tokens):
            raise ValueError(
                f"{self.slot_mapping.shape[0]} slots for {sum(self.num_new_tokens)} new tokens"
            )


def first_key_position(num_cached_tokens: int, sliding_window: int | None) -> int:
    """Return the oldest position the first new token may attend to."""
    if sliding_window is None:
        return 0
    return max(0, num_cached_tokens - sliding_window + 1)


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `key` and `value` ([num_tokens, num_kv_heads, head_dim]) into their slots."""
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[KV_DIM_KEY].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[KV_DIM_VALUE].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    sliding_window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attend each new token to its sequence's keys; return [num_tokens, num_heads, head_dim].

    `query` is [num_tokens, num_heads, head_dim]; the new tokens' K/V must already be
    written (`write_kv`). Causal; with `sliding_window` a query at p sees keys in
    (p - window, p]. Blocks wholly before the window are never read (they may be the null
    block); stale values in the window's first block are zeroed before use, so masked
    positions may hold any garbage, NaN included.
    """
    output = torch.empty_like(query)
    start = 0
    for i, (num_cached, num_new) in enumerate(
        zip(metadata.num_cached_tokens, metadata.num_new_tokens, strict=True)
    ):
        end = start + num_new
        output[start:end] = _attend_sequence(
            query[start:end],
            kv_cache,
            metadata.block_tables[i],
            _Span(num_cached, num_new, sliding_window),
            scale,
        )
        start = end
    return output


@dataclass(frozen=True)
class _Span:
    num_cached_tokens: int
    num_new_tokens: int
    sliding_window: int | None


def _attend_sequence(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    span: _Span,
    scale: float,
) -> torch.Tensor:
    block_size = kv_cache.shape[2]
    num_cached, window = span.num_cached_tokens, span.sliding_window
    num_tokens = num_cached + span.num_new_tokens
    first_key = first_key_position(num_cached, window)
    first_block = first_key // block_size
    end_block = -(-num_tokens // block_size)
    if end_block > block_table.shape[0]:
        raise ValueError(
            f"block table of {block_table.shape[0]} blocks cannot hold {num_tokens} tokens "
            f"of {block_size} per block"
        )
    block_ids = block_table[first_block:end_block]
    base = first_block * block_size  # position of the first gathered key
    num_keys = num_tokens - base
    kv = kv_cache.index_select(1, block_ids).flatten(1, 2)[:, :num_keys]
    key, value = kv[KV_DIM_KEY], kv[KV_DIM_VALUE]
    num_dead = first_key - base
    if num_dead:
        # Out of every query's window; zero them so garbage (NaN) cannot reach the output.
        kv[:, :num_dead] = 0
    mask = None
    if window is not None or span.num_new_tokens > 1:  # one query at the end sees every key
        device = query.device
        query_pos = torch.arange(num_cached, num_tokens, device=device)[:, None]
        key_pos = torch.arange(base, num_tokens, device=device)[None, :]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
    return _grouped_sdpa(query, key, value, mask, scale)


def _grouped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    # Grouped-query attention without copying K/V per query head: the queries of the heads
    # sharing a KV head become one longer query sequence (query head h uses KV head
    # h // group). 4-D inputs let CPU builds use their fused kernel instead of plain math.
    num_new, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    folded = query.view(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    out = functional.scaled_dot_product_attention(
        folded.reshape(1, num_kv_heads, group * num_new, head_dim),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        attn_mask=None if mask is None else mask.repeat(group, 1),
        scale=scale,
    )
    out = out.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3)
    return out.reshape(num_new, num_heads, head_dim)
