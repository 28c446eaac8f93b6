"""A Llama/Qwen2-style decoder over a paged KV cache.

RMSNorm, rotary position embeddings, grouped-query attention (full or sliding window per
layer) and a SwiGLU MLP. Module and parameter names follow the HF checkpoints without
their `model.` prefix, so loading weights is a rename (see `weights`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional

from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.paged_attention import AttentionMetadata, paged_attention, write_kv

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x`."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Embedding(nn.Module):
    """Token embedding table, left uninitialised (see `init_weights`)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        # nn.Embedding would initialise on construction, which on the meta device pulls
        # in torch's Python decompositions (about a second of imports).
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Return the embeddings [num_tokens, hidden_size] of `token_ids`."""
        return functional.embedding(token_ids, self.weight)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return cos and sin tables ([num_tokens, head_dim]) for `positions`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` ([num_tokens, num_heads, head_dim]) by its positions' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Grouped-query self-attention of one layer, reading and writing the paged cache."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        is_sliding = config.layer_kinds[layer_id] is AttentionKind.SLIDING
        self.sliding_window = config.sliding_window if is_sliding else None
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V into `kv_cache` and return the attention output."""
        num_tokens = hidden.shape[0]
        cos, sin = rotary
        query = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        key = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        out = paged_attention(
            query, kv_cache, metadata, self.sliding_window, scale=self.head_dim**-0.5
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to `x` ([num_tokens, hidden_size])."""
        return self.down_proj(functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Return the layer's output for `hidden` ([num_tokens, hidden_size])."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    """The whole decoder: embeddings, layers, final norm and LM head.

    Build it with `build_model` (random weights) or `weights.load_model` (a checkpoint).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied embeddings reuse `embed_tokens.weight` in `compute_logits`: no shared
        # Parameter objects, which moving a meta-device model would silently untie.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.layer_group_ids = tuple(
            next(g.group_id for g in config.layer_groups() if i in g.layer_ids)
            for i in range(config.num_layers)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        group_metadata: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Run the batch's new tokens; return final hidden states [num_tokens, hidden_size].

        `kv_caches[i]` is layer i's cache; `group_metadata[g]` describes the step for KV
        group g (see `ModelConfig.layer_groups`).
        """
        hidden = self.embed_tokens(input_ids)
        rotary = rotary_cos_sin(
            positions, self.config.head_dim, self.config.rope_theta, hidden.dtype
        )
        for layer, kv_cache, group_id in zip(
            self.layers, kv_caches, self.layer_group_ids, strict=True
        ):
            hidden = layer(hidden, rotary, kv_cache, group_metadata[group_id])
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return float32 logits [num_tokens, vocab_size] for final hidden states."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return functional.linear(hidden, weight).float()


def init_weights(model: DecoderModel, seed: int) -> None:
    """Fill `model` with random weights: N(0, 0.02) matrices, zero biases, unit norms.

    Numbers come from a CPU generator seeded with `seed`, so every device gets the same model.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                values = torch.ones(param.shape)
            elif name.endswith(".bias"):
                values = torch.zeros(param.shape)
            else:
                values = torch.randn(param.shape, generator=generator) * INIT_STD
            param.copy_(values)


def empty_model(config: ModelConfig, device: torch.device | str = "cpu") -> DecoderModel:
    """Return a model with uninitialised weights on `device` in `config.dtype`, in eval mode.

    Parameters do not require gradients: the engine only runs inference.
    """
    with torch.device("meta"):  # no wasted default initialisation
        model = DecoderModel(config)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=config.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=False))
    return model.eval()


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", seed: int = 0
) -> DecoderModel:
    """Return a randomly initialised model (see `init_weights`) on `device`, in eval mode."""
    model = empty_model(config, device)
    init_weights(model, seed)
    return model
