"""Reference (dense, unpaged) computations and small factories for the engine tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.engine.config import CacheConfig, ModelConfig
from kvtier.engine.model import DecoderModel, apply_rotary, build_model, rotary_cos_sin
from kvtier.engine.runner import ModelRunner, SequenceInput

# ModelConfig.tiny() as a Hugging Face config.json: what a local checkpoint directory holds.
TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attend `query` [n, Hq, D] to keys at positions 0..T-1 with plain softmax math."""
    repeat = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(repeat, dim=1)
    value = value.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, key) * query.shape[-1] ** -0.5
    key_positions = torch.arange(key.shape[0])[None, :]
    allowed = key_positions <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= key_positions > query_positions[:, None] - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)


@torch.no_grad()
def dense_logits(model: DecoderModel, token_ids: Sequence[int]) -> torch.Tensor:
    """Return logits [len(token_ids), vocab] of a full forward pass without any cache."""
    config = model.config
    num_tokens = len(token_ids)
    positions = torch.arange(num_tokens)
    hidden = model.embed_tokens(torch.tensor(token_ids))
    cos, sin = rotary_cos_sin(positions, config.head_dim, config.rope_theta, hidden.dtype)
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(num_tokens, config.num_heads, config.head_dim)
        k = attn.k_proj(x).view(num_tokens, config.num_kv_heads, config.head_dim)
        v = attn.v_proj(x).view(num_tokens, config.num_kv_heads, config.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = reference_attention(q, k, v, positions, attn.sliding_window)
        hidden = hidden + attn.o_proj(out.reshape(num_tokens, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.compute_logits(model.norm(hidden))


def make_runner(
    config: ModelConfig, cache: CacheConfig | None = None, seed: int = 0
) -> ModelRunner:
    """Return a CPU runner over a random model."""
    return ModelRunner(build_model(config, seed=seed), cache or CacheConfig(4, 64))


def shuffled_tables(
    runner: ModelRunner, lengths: Sequence[int], generator: torch.Generator
) -> list[tuple[tuple[int, ...], ...]]:
    """Return per sequence one block table per group covering `lengths[i]` tokens.

    Blocks are random, non-null, and never shared between the sequences.
    """
    per_group = []
    for _ in runner.layer_groups:
        free = (
            torch.randperm(runner.cache_config.num_blocks - 1, generator=generator) + 1
        ).tolist()
        tables = []
        for num_tokens in lengths:
            num_blocks = -(-num_tokens // runner.block_size)
            tables.append(tuple(free[:num_blocks]))
            del free[:num_blocks]
        per_group.append(tables)
    return [tuple(group[i] for group in per_group) for i in range(len(lengths))]


def step(
    token_ids: Sequence[int], num_cached_tokens: int, tables: tuple[tuple[int, ...], ...]
) -> SequenceInput:
    """Return a `SequenceInput` computing `token_ids` after `num_cached_tokens`."""
    return SequenceInput(tuple(token_ids), num_cached_tokens, tables)
