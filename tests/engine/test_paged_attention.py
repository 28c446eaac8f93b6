"""Paged attention against dense attention on random caches and block tables."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import reference_attention

from kvtier.engine.paged_attention import (
    AttentionMetadata,
    first_key_position,
    kv_cache_shape,
    paged_attention,
    write_kv,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 48
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
# (num_cached_tokens, num_new_tokens): prefill, decode, suffix prefill, chunk, aligned edges
SPANS = [(0, 7), (5, 1), (13, 6), (32, 1), (9, 20), (8, 8), (0, 1), (3, 1)]


def _random_case(seed: int, sliding_window: int | None) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    cache = torch.full(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), torch.nan)
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    tables, slots, queries, expected = [], [], [], []
    for num_cached, num_new in SPANS:
        total = num_cached + num_new
        table = [perm.pop() for _ in range(-(-total // BLOCK_SIZE))]
        key = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        value = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        seq_slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                  for p in range(total)])  # fmt: skip
        # The cached part was written by earlier steps; the new part is written per step.
        write_kv(cache, key[:num_cached], value[:num_cached], seq_slots[:num_cached])
        first_key = first_key_position(num_cached, sliding_window)
        for block in range(first_key // BLOCK_SIZE):
            table[block] = 0  # out of the window: the engine replaced it by the null block
        flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
        dead = seq_slots[(first_key // BLOCK_SIZE) * BLOCK_SIZE : first_key]
        flat[:, dead] = torch.nan  # stale garbage in the first block of the window
        query = torch.randn(num_new, NUM_HEADS, HEAD_DIM, generator=gen)
        positions = torch.arange(num_cached, total)
        expected.append(reference_attention(query, key, value, positions, sliding_window))
        tables.append(table + [0] * (12 - len(table)))
        slots.append(seq_slots[num_cached:])
        queries.append((query, key[num_cached:], value[num_cached:]))
    return cache, tables, slots, queries, expected


def _step(
    cache: torch.Tensor, tables: Any, slots: Any, queries: Any
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Write the step's new KV of `_random_case`'s sequences into `cache`; return the
    step's metadata and its queries."""
    slot_mapping = torch.cat(slots)
    write_kv(
        cache, torch.cat([q[1] for q in queries]), torch.cat([q[2] for q in queries]), slot_mapping
    )
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=torch.tensor(tables),
        num_cached_tokens=tuple(c for c, _ in SPANS),
        num_new_tokens=tuple(n for _, n in SPANS),
    )
    return metadata, torch.cat([q[0] for q in queries])


@pytest.mark.parametrize("sliding_window", [None, 1, 3, 4, 8, 13])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_equals_dense(seed: int, sliding_window: int | None) -> None:
    cache, tables, slots, queries, expected = _random_case(seed, sliding_window)
    cache[:, 0] = torch.nan  # the null block holds garbage
    metadata, query = _step(cache, tables, slots, queries)
    out = paged_attention(query, cache, metadata, sliding_window, scale=HEAD_DIM**-0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_write_kv_fills_exactly_the_slots() -> None:
    cache = torch.zeros(kv_cache_shape(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    key = torch.ones(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv(cache, key, 2 * key, torch.tensor([5, 6, 12]))
    written = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM).sum(dim=(2, 3))
    assert written[0].nonzero().flatten().tolist() == [5, 6, 12]
    assert cache[1, 1, 1].eq(2).all()
    assert cache[1, 3, 0].eq(2).all()


def test_short_block_table_is_rejected() -> None:
    cache = torch.zeros(kv_cache_shape(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([8]),
        block_tables=torch.tensor([[1, 2]]),
        num_cached_tokens=(8,),
        num_new_tokens=(1,),
    )
    query = torch.zeros(1, NUM_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        paged_attention(query, cache, metadata, None, scale=1.0)


def test_metadata_checks_lengths() -> None:
    with pytest.raises(ValueError, match="3 slots for 2 new tokens"):
        AttentionMetadata(torch.zeros(3, dtype=torch.int64), torch.zeros(1, 1), (0,), (2,))


def test_write_kv_casts_keys_and_values_to_the_cache_dtype() -> None:
    """float32 K/V written into a bfloat16 cache land in their slots, rounded."""
    cache = torch.zeros(kv_cache_shape(3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    write_kv(cache, key, value, torch.tensor([5, 10]))  # block 1 offset 1, block 2 offset 2
    assert torch.equal(cache[0, 1, 1], key[0].bfloat16())
    assert torch.equal(cache[0, 2, 2], key[1].bfloat16())
    assert torch.equal(cache[1, 2, 2], value[1].bfloat16())
    assert int(cache.count_nonzero()) == 4 * NUM_KV_HEADS * HEAD_DIM


def test_scale_is_the_one_given() -> None:
    """`scale` multiplies the scores: scale 3/sqrt(D) on q is the default scale on 3q."""
    cache, tables, slots, queries, _ = _random_case(2, None)
    metadata, query = _step(cache, tables, slots, queries)
    scaled = paged_attention(query, cache, metadata, None, scale=3 * HEAD_DIM**-0.5)
    expected = paged_attention(3 * query, cache, metadata, None, scale=HEAD_DIM**-0.5)
    torch.testing.assert_close(scaled, expected, atol=1e-5, rtol=1e-5)


def test_blocks_before_the_window_are_never_read() -> None:
    """A block wholly out of the window is not looked up (any id may sit there): a decode
    step reads the window's blocks only, not the whole table."""
    cache = torch.randn(kv_cache_shape(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    # 10 cached tokens, window 3: the new token at 10 sees 8..10, all in block 2 of the table.
    table = [10**6, 10**6, 3, 0]
    metadata = AttentionMetadata(
        torch.tensor([3 * BLOCK_SIZE + 2]), torch.tensor([table]), (10,), (1,)
    )
    query = torch.randn(1, NUM_HEADS, HEAD_DIM)
    out = paged_attention(query, cache, metadata, 3, scale=HEAD_DIM**-0.5)
    key, value = cache[0, 3, :3], cache[1, 3, :3]
    expected = reference_attention(query, key, value, torch.tensor([2]), None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("cached", "new", "num_tables", "message"),
    [
        ((0, 0), (1,), 1, "2 cached counts for 1 new counts"),
        ((0,), (1,), 2, "2 block tables for 1 sequences"),
    ],
)
def test_metadata_checks_counts_and_tables(
    cached: tuple[int, ...], new: tuple[int, ...], num_tables: int, message: str
) -> None:
    """One cached count and one block table per sequence, else a clear error."""
    slots = torch.zeros(sum(new), dtype=torch.int64)
    with pytest.raises(ValueError, match=message):
        AttentionMetadata(slots, torch.zeros(num_tables, 1, dtype=torch.int64), cached, new)
