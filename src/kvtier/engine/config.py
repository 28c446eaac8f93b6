"""Model, KV cache and engine configuration of the reference engine, with presets and HF import."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


class AttentionKind(enum.Enum):
    """How a layer attends: to every earlier token, or to a window of recent ones."""

    FULL = "full"
    SLIDING = "sliding"


@dataclass(frozen=True)
class LayerGroup:
    """The layers of one KV group: same attention kind and window, one block table."""

    group_id: int
    kind: AttentionKind
    sliding_window: int | None
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama/Qwen2-style decoder.

    `layer_kinds[i]` is the attention kind of layer i; `sliding_window` (in tokens) is
    required exactly when some layer is `SLIDING`: a query at position p then attends to
    keys at positions in (p - sliding_window, p].
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[AttentionKind, ...]
    sliding_window: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 32768
    qkv_bias: bool = False
    o_proj_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(
                f"layer_kinds has {len(self.layer_kinds)} entries for num_layers={self.num_layers}"
            )
        if any(not isinstance(kind, AttentionKind) for kind in self.layer_kinds):
            raise ValueError(f"layer_kinds must hold AttentionKind values, got {self.layer_kinds}")
        has_sliding = AttentionKind.SLIDING in self.layer_kinds
        if has_sliding and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(
                f"sliding layers need a positive int sliding_window, got {self.sliding_window!r}"
            )
        if not has_sliding and self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window} but no layer is SLIDING")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} must be > 0"
            )
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {self.dtype}")

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """Return the KV groups: full-attention layers first, then sliding layers, if any."""
        groups: list[LayerGroup] = []
        for kind in AttentionKind:
            layer_ids = tuple(i for i, k in enumerate(self.layer_kinds) if k is kind)
            if layer_ids:
                window = self.sliding_window if kind is AttentionKind.SLIDING else None
                groups.append(LayerGroup(len(groups), kind, window, layer_ids))
        return tuple(groups)

    def kv_bytes_per_token(self) -> int:
        """Return the bytes of K and V one token occupies over all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @staticmethod
    def tiny() -> ModelConfig:
        """Return a 2-layer full-attention model small enough for unit tests."""
        return ModelConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            layer_kinds=(AttentionKind.FULL,) * 2,
        )

    @staticmethod
    def tiny_hybrid() -> ModelConfig:
        """Return a 2-layer model with one full and one sliding-window (8 tokens) layer."""
        return dataclasses.replace(
            ModelConfig.tiny(),
            layer_kinds=(AttentionKind.FULL, AttentionKind.SLIDING),
            sliding_window=8,
        )

    @staticmethod
    def demo() -> ModelConfig:
        """Return the demo model: prefill costs far more than copying its K/V back.

        About 20 M parameters (6 layers, hidden 512); 6 KiB of K/V per token in float32
        (8 query heads share 2 KV heads of 64).
        """
        return ModelConfig(
            vocab_size=1024,
            hidden_size=512,
            intermediate_size=1536,
            num_layers=6,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            layer_kinds=(AttentionKind.FULL,) * 6,
        )

    @staticmethod
    def from_hf_config(path: str | Path, dtype: torch.dtype = torch.float32) -> ModelConfig:
        """Read a local HF `config.json` (a file or the checkpoint directory holding it).

        Supports LlamaForCausalLM and Qwen2ForCausalLM with default RoPE and SiLU. Sliding
        layers come from `layer_types`, else `max_window_layers`, when the window is on.
        """
        path = Path(path)
        config_path = path / "config.json" if path.is_dir() else path
        with config_path.open(encoding="utf-8") as f:
            hf = json.load(f)
        if not isinstance(hf, dict):
            raise ValueError(f"{config_path}: expected a JSON object, got {type(hf).__name__}")
        return _from_hf_dict(hf, dtype, str(config_path))


def _from_hf_dict(hf: dict[str, Any], dtype: torch.dtype, source: str) -> ModelConfig:
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"{source}: architectures must be a list, got {architectures!r}")
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(
            f"{source}: architectures={architectures} not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} not supported (only 'silu')")
    if hf.get("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=True not supported")
    num_layers = _hf_positive_int(hf, "num_hidden_layers", source)
    num_heads = _hf_positive_int(hf, "num_attention_heads", source)
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(hf.get("attention_bias", False))
    window, kinds = _hf_layer_kinds(hf, num_layers, source)
    eos = hf.get("eos_token_id")
    eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if any(type(token) is not int or token < 0 for token in eos_token_ids):
        raise ValueError(
            f"{source}: eos_token_id must be a token id or a list of them, got {eos!r}"
        )
    kv_heads = hf.get("num_key_value_heads")  # absent or null: as many as the query heads
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads
        if kv_heads is None
        else _hf_positive_int(hf, "num_key_value_heads", source),
        head_dim=hf.get("head_dim") or _hf_positive_int(hf, "hidden_size", source) // num_heads,
        layer_kinds=kinds,
        sliding_window=window,
        rope_theta=_hf_rope_theta(hf, source),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position=hf.get("max_position_embeddings", 32768),
        qkv_bias=is_qwen2 or attention_bias,
        o_proj_bias=attention_bias and not is_qwen2,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_ids=eos_token_ids,
        dtype=dtype,
    )


def _hf_positive_int(hf: dict[str, Any], key: str, source: str) -> int:
    """Return `hf[key]`, a value the reader computes with before ModelConfig checks it."""
    value = hf[key]  # a missing key: KeyError, named by the caller
    if type(value) is not int or value <= 0:
        raise ValueError(f"{source}: {key} must be a positive int, got {value!r}")
    return value


def _hf_rope_theta(hf: dict[str, Any], source: str) -> float:
    # transformers >= 5 nests RoPE settings in `rope_parameters`; older files use
    # top-level `rope_theta` and `rope_scaling`.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(
            f"{source}: rope_parameters (or rope_scaling) must be an object, got {rope!r}"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{source}: rope_type={rope_type!r} not supported (only 'default')")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if type(theta) not in (int, float):
        raise ValueError(f"{source}: rope_theta must be a number, got {theta!r}")
    return float(theta)


def _hf_layer_kinds(
    hf: dict[str, Any], num_layers: int, source: str
) -> tuple[int | None, tuple[AttentionKind, ...]]:
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is None:
        return None, (AttentionKind.FULL,) * num_layers
    names = {"full_attention": AttentionKind.FULL, "sliding_attention": AttentionKind.SLIDING}
    if hf.get("layer_types") is not None:
        if not isinstance(hf["layer_types"], list):
            raise ValueError(f"{source}: layer_types must be a list, got {hf['layer_types']!r}")
        unknown = set(map(str, hf["layer_types"])) - names.keys()
        if unknown:
            raise ValueError(f"{source}: layer_types {sorted(unknown)} not supported")
        kinds = tuple(names[t] for t in hf["layer_types"])
    else:
        first_sliding = hf.get("max_window_layers", 0)
        if type(first_sliding) is not int or first_sliding < 0:
            raise ValueError(
                f"{source}: max_window_layers must be an int >= 0, got {first_sliding!r}"
            )
        kinds = tuple(
            AttentionKind.SLIDING if i >= first_sliding else AttentionKind.FULL
            for i in range(num_layers)
        )
    if AttentionKind.SLIDING not in kinds:
        return None, kinds
    logger.info("%s: sliding window of %d tokens on %d layers", source, window,
                kinds.count(AttentionKind.SLIDING))  # fmt: skip
    return int(window), kinds


@dataclass(frozen=True)
class CacheConfig:
    """Size of the paged KV cache.

    Every KV group gets `num_blocks` blocks of `block_size` tokens in each of its layers;
    block 0 is the null block, so `num_blocks - 1` are usable.
    """

    block_size: int = 16
    num_blocks: int = 256

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} leaves no block besides the null block")


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and limits of the reference engine. `num_gpu_blocks` includes the null block.

    A value of the wrong type raises TypeError, one out of range ValueError, both naming
    the field.
    """

    block_size: int = 16
    num_gpu_blocks: int = 256
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    device: str = "cpu"
    seed: int = 0
    keep_logits: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"EngineConfig.{name} must be a positive int, got {value!r}")
            if value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.num_gpu_blocks < 2:
            raise ValueError(
                f"EngineConfig.num_gpu_blocks={self.num_gpu_blocks} leaves no block besides "
                "the null block"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"EngineConfig.seed must be an int, got {self.seed!r}")
        if not -(2**63) <= self.seed < 2**64:  # what torch.manual_seed accepts
            raise ValueError(f"EngineConfig.seed must be in [-2**63, 2**64), got {self.seed}")
        if not isinstance(self.keep_logits, bool):
            raise TypeError(f"EngineConfig.keep_logits must be a bool, got {self.keep_logits!r}")
        if not isinstance(self.device, str):
            raise TypeError(f"EngineConfig.device must be a str, got {self.device!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"EngineConfig.device={self.device!r} is not a torch device") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"EngineConfig.device={self.device!r}: the engine runs on 'cpu' or 'cuda[:N]'"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"EngineConfig.device={self.device!r}, but CUDA is not available")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(
                f"EngineConfig.device={self.device!r}, but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s) (cuda:0 ...)"
            )
