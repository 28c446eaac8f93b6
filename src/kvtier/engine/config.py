"""Model, KV cache and engine configuration of the reference engine, with presets (HF
config.json import: `hf_config`)."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

import torch

from kvtier.core.plural import counted

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
    keys at positions in (p - sliding_window, p]. `eos_token_ids` must lie in the vocab.

    `eos_stop_token_ids` are those of `eos_token_ids` that vLLM takes as stop token ids
    (a checkpoint's generation config EOS ids besides its tokenizer's EOS): they stop a
    request as the others do (not with `ignore_eos`) but are its `stop_reason`, as in
    vLLM; the others stop it with no `stop_reason`.
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
    eos_stop_token_ids: tuple[int, ...] = ()

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
        window = self.sliding_window
        if has_sliding and (type(window) is not int or window <= 0):
            raise ValueError(
                f"sliding layers need a positive int sliding_window, got {self.sliding_window!r}"
            )
        if not has_sliding and self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window} but no layer is SLIDING")
        eos = self.eos_token_ids
        if not isinstance(eos, tuple) or any(type(t) is not int or t < 0 for t in eos):
            raise ValueError(f"eos_token_ids must be a tuple of token ids (ints >= 0), got {eos!r}")
        beyond = [t for t in eos if t >= self.vocab_size]
        if beyond:
            raise ValueError(
                f"eos_token_ids {beyond} outside the vocab [0, {self.vocab_size}): "
                "never sampled, they could never stop generation"
            )
        stops = self.eos_stop_token_ids
        if not isinstance(stops, tuple) or not set(stops) <= set(eos):
            raise ValueError(
                f"eos_stop_token_ids must be a tuple of some of eos_token_ids {eos}, got {stops!r}"
            )
        self._check_numbers_and_flags()

    def _check_numbers_and_flags(self) -> None:
        # A NaN or infinite theta or eps makes every logit NaN; a truthy non-bool flag
        # ("false") would tie the embeddings or add biases.
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not is_number or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a finite number > 0")
        for name in ("qkv_bias", "o_proj_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(
                f"ModelConfig.dtype must be a floating point torch.dtype, got {self.dtype!r}"
            )

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
        """Read a local HF `config.json` (a file or the checkpoint directory holding it);
        see `kvtier.engine.hf_config.read_hf_config`."""
        from kvtier.engine.hf_config import read_hf_config  # it imports this module

        return read_hf_config(path, dtype)


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

    `seed` seeds a random model's weights and the temperature sampling of requests
    without `SamplingParams.seed` (see `LLM`); torch's global RNG is left alone. It is in
    [0, 2**64): torch would seed a negative one as another, 2**64 + seed.

    `device` is "cpu", "cuda" or "cuda:N", or a `torch.device` of one, stored as its
    str ("cuda:1"). A value of the wrong type raises TypeError, one out of range
    ValueError, both naming the field. Numpy integers are taken as, and stored as,
    Python ints.

    `max_logprobs` is vLLM's: the most `SamplingParams.logprobs` a request may ask for
    (20, as vLLM's default; -1: no cap, the whole vocab); a request asking for more
    (`logprobs=-1` asks for the vocab) is refused.
    """

    block_size: int = 16
    num_gpu_blocks: int = 256
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    device: str | torch.device = "cpu"
    seed: int = 0
    keep_logits: bool = False
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        # Numpy integers are taken as, and stored as, Python ones (as in SamplingParams).
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, Integral) or isinstance(value, bool):
                raise TypeError(f"EngineConfig.{name} must be a positive int, got {value!r}")
            if value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.num_gpu_blocks < 2:
            raise ValueError(
                f"EngineConfig.num_gpu_blocks={self.num_gpu_blocks} leaves no block besides "
                "the null block"
            )
        if not isinstance(self.seed, Integral) or isinstance(self.seed, bool):
            raise TypeError(f"EngineConfig.seed must be an int, got {self.seed!r}")
        # torch.manual_seed takes [-2**63, 2**64) but seeds a negative seed as 2**64 + seed,
        # so -1 would silently give the model and samples of 2**64 - 1 (and is vLLM's
        # "no seed" in SamplingParams): refused, as negative seeds elsewhere.
        if not 0 <= self.seed < 2**64:
            raise ValueError(
                f"EngineConfig.seed must be in [0, 2**64), got {self.seed}"
                + (f" (torch would seed it as {2**64 + self.seed})" if self.seed < 0 else "")
            )
        object.__setattr__(self, "seed", int(self.seed))
        if not isinstance(self.max_logprobs, Integral) or isinstance(self.max_logprobs, bool):
            raise TypeError(f"EngineConfig.max_logprobs must be an int, got {self.max_logprobs!r}")
        if self.max_logprobs < -1:
            raise ValueError(
                f"EngineConfig.max_logprobs must be >= 0, or -1 (no cap), got {self.max_logprobs}"
            )
        object.__setattr__(self, "max_logprobs", int(self.max_logprobs))
        if not isinstance(self.keep_logits, bool):
            raise TypeError(f"EngineConfig.keep_logits must be a bool, got {self.keep_logits!r}")
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        if not isinstance(self.device, str):
            raise TypeError(
                f"EngineConfig.device must be a str or torch.device, got {self.device!r}"
            )
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
                f"{counted(torch.cuda.device_count(), 'CUDA device')} (cuda:0 ...)"
            )
