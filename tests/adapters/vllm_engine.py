"""vLLM engine pieces for the test harness: a tiny model, configs, a fake KV cache.

Test helper only (see `vllm_harness`). `build_scheduler` builds a real vLLM `Scheduler`
and its scheduler-role connector on CPU from a `HarnessConfig`; `FakeKVCache` is the
"GPU" KV cache of one rank, holding a fingerprint of each position's token prefix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

SIMPLE_CPU_OFFLOAD = "SimpleCPUOffloadConnector"

_FINGERPRINT_MOD = 2_147_483_629  # a prime below 2**31: fingerprints fit in int32
_FINGERPRINT_MUL = 1_000_003


class KVMismatchError(AssertionError):
    """A position counted as computed holds KV of a different token prefix."""


@dataclass(frozen=True)
class HarnessConfig:
    """One engine: the tiny model, cache geometry, scheduler limits and connector.

    `connector` is the `kv_connector` class name (None: no connector); with
    `connector_module` it is loaded from that module, otherwise from vLLM's registry.
    `num_gpu_blocks` counts the null block. `kv_cache_layout` is a `KVCacheLayout` name
    (LBNHC: layer-outermost, vLLM's usual; BLNHC: block-outermost). `num_ranks` is the
    tensor-parallel size: the world size connectors see, and one fake worker per rank.
    `kv_load_failure_policy` is vLLM's: "fail" (its default) or "recompute".
    `async_scheduling` is vLLM's flag (its default in 0.33; off here): the harness builds
    an `AsyncScheduler`, whose sampled tokens are placeholders until the step's output is
    processed. `batch_queue_size` is the steps in flight at once, as in vLLM's engine
    core (2 under asynchronous scheduling): the harness schedules step N+1 before it
    processes step N's output. 1 runs lock-step; more needs `async_scheduling`.
    `kv_role` is vLLM's.
    """

    connector: str | None = None
    connector_module: str | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    block_size: int = 16
    num_gpu_blocks: int = 256
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 16
    kv_cache_layout: str = "LBNHC"
    enable_kv_events: bool = False
    num_ranks: int = 1
    kv_load_failure_policy: str = "fail"
    async_scheduling: bool = False
    batch_queue_size: int = 1
    kv_role: str = "kv_both"

    def __post_init__(self) -> None:
        if self.batch_queue_size > 1 and not self.async_scheduling:
            raise ValueError("overlapping steps need async_scheduling, as in vLLM")

    @property
    def layer_names(self) -> list[str]:
        """Return the attention layer names, one per KV cache tensor."""
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]

    @property
    def attention_spec(self) -> FullAttentionSpec:
        """Return the one full-attention spec every layer shares."""
        return FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=torch.float16,
        )


def write_tiny_llama(directory: str, cfg: HarnessConfig) -> None:
    """Write a tiny Llama `config.json`: enough for `ModelConfig`, no weights, no hub."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.num_kv_heads * cfg.head_size * 2,
        "intermediate_size": 128,
        "num_attention_heads": cfg.num_kv_heads * 2,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": 32000,
        "max_position_embeddings": cfg.max_model_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float16",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def build_vllm_config(cfg: HarnessConfig, model_dir: str) -> VllmConfig:
    """Return a CPU `VllmConfig` for the tiny model in `model_dir`."""
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=cfg.max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=cfg.async_scheduling,
    )
    cache_config = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=True)
    kv_transfer_config = None
    if cfg.connector is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=cfg.connector,
            kv_connector_module_path=cfg.connector_module,
            kv_role=cfg.kv_role,
            kv_connector_extra_config=dict(cfg.extra_config),
            kv_load_failure_policy=cfg.kv_load_failure_policy,
        )
    kv_events_config = None
    if cfg.enable_kv_events:
        kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    vllm_config = VllmConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(tensor_parallel_size=cfg.num_ranks),
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        kv_events_config=kv_events_config,
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = cfg.num_gpu_blocks
    # vLLM's CPU platform turns asynchronous scheduling off; the harness stands in for a
    # GPU engine, where it stays as configured (and makes the scheduler defer block
    # frees for a KV consumer, `max_concurrent_batches` being 2).
    vllm_config.scheduler_config.async_scheduling = cfg.async_scheduling
    return vllm_config


def build_kv_cache_config(cfg: HarnessConfig, vllm_config: VllmConfig) -> KVCacheConfig:
    """Plan the KV cache the way the engine core does: one allocation, one group."""
    vllm_config.cache_config.kv_cache_layout = cfg.kv_cache_layout
    vllm_config.cache_config.num_gpu_blocks_override = cfg.num_gpu_blocks
    group = KVCacheGroupSpec(cfg.layer_names, cfg.attention_spec)
    bytes_per_block = cfg.num_layers * cfg.attention_spec.page_size_bytes
    config = get_kv_cache_config_from_groups(
        vllm_config, [group], cfg.num_gpu_blocks * bytes_per_block
    )
    assert config.num_blocks == cfg.num_gpu_blocks
    # The engine core resolves these before building the scheduler.
    config.kv_cache_layout = cfg.kv_cache_layout
    config.hash_block_size = cfg.block_size
    config.cache_hit_alignment_tokens = cfg.block_size
    return config


def build_scheduler(
    cfg: HarnessConfig, model_dir: str
) -> tuple[Scheduler, VllmConfig, KVCacheConfig]:
    """Build a real vLLM `Scheduler` (and its scheduler-role connector) on CPU.

    An `AsyncScheduler` when `cfg.async_scheduling`, as vLLM's engine core picks it.
    """
    vllm_config = build_vllm_config(cfg, model_dir)
    assert vllm_config.scheduler_config.async_scheduling == cfg.async_scheduling
    kv_cache_config = build_kv_cache_config(cfg, vllm_config)
    register_all_kvcache_specs(vllm_config)
    scheduler_cls = AsyncScheduler if cfg.async_scheduling else Scheduler
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=cfg.block_size,
        hash_block_size=cfg.block_size,
        log_stats=True,
    )
    return scheduler, vllm_config, kv_cache_config


# --------------------------------------------------------------------------- fake KV


class PrefixFingerprints:
    """Fingerprint of every token prefix of a request: equal prefixes, equal values."""

    def __init__(self) -> None:
        self._values: dict[str, list[int]] = {}
        self._guessed: dict[str, dict[int, int]] = {}  # request id -> position -> token

    def upto(
        self, request: Request, num_tokens: int, token_at: Callable[[int], int] | None = None
    ) -> list[int]:
        """Return fingerprints of the prefixes ending at positions `0..num_tokens-1`.

        A position past the request's tokens (an output placeholder of asynchronous
        scheduling: sampled, not yet delivered) takes its token from `token_at`, what the
        model runner sampled there; once vLLM delivers that position, the token must be
        the same (AssertionError otherwise: vLLM and the runner disagree on the prefix).
        """
        request_id = request.request_id
        values = self._values.setdefault(request_id, [])
        token_ids = request.all_token_ids
        guessed = self._guessed.setdefault(request_id, {})
        for pos in [pos for pos in guessed if pos < len(token_ids)]:
            token = guessed.pop(pos)
            assert token_ids[pos] == token, f"{request_id}: position {pos} delivered another token"
        prev = values[-1] if values else 0
        for pos in range(len(values), num_tokens):
            if pos < len(token_ids):
                token = token_ids[pos]
            else:
                assert token_at is not None, f"{request_id}: position {pos} has no token yet"
                token = guessed[pos] = token_at(pos)
            prev = (prev * _FINGERPRINT_MUL + token + 1) % _FINGERPRINT_MOD
            values.append(prev)
        return values[:num_tokens]

    def forget(self, request_id: str) -> None:
        """Drop a finished request's fingerprints."""
        self._values.pop(request_id, None)
        self._guessed.pop(request_id, None)


class FakeKVCache:
    """The "GPU" KV cache of one rank, laid out exactly as `kv_cache_config` places it.

    One zeroed int8 allocation of the planned size; `tensors` are vLLM's own per-layer
    `[B, H, N, C]` views into it (what `register_kv_caches` receives on a GPU), so
    copies by block id and region discovery from the placement behave as on a GPU.
    Token `n` of block `b` holds its prefix fingerprint xor the layer index in the first
    4 content bytes of head 0, and the fingerprint plus the layer index in the last 4
    content bytes of the last head.
    """

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        (group,) = kv_cache_config.kv_cache_groups
        spec = group.kv_cache_spec
        layout = KVCacheLayout[kv_cache_config.kv_cache_layout or "LBNHC"]
        self.block_size = spec.block_size
        self.raw = torch.zeros(kv_cache_config.kv_cache_tensors[0].size, dtype=torch.int8)
        self.tensors: dict[str, torch.Tensor] = {}
        for placement in kv_cache_config.kv_cache_tensors:
            views = create_kv_cache_views(
                self.raw, spec, kv_cache_config.num_blocks, layout, placement
            )
            self.tensors.update(zip(placement.layers, views, strict=True))
        self._bytes = [view.view(torch.int8) for view in self.tensors.values()]

    def write(self, block_ids: Sequence[int], start: int, fingerprints: Sequence[int]) -> None:
        """Write `fingerprints[p]` for positions `start..len(fingerprints)-1`."""
        blocks, offsets = self._slots(block_ids, start, len(fingerprints))
        values = torch.tensor(fingerprints[start:], dtype=torch.int32)
        for layer, cache in enumerate(self._bytes):
            cache[blocks, 0, offsets, :4] = _as_bytes(values ^ layer)
            cache[blocks, -1, offsets, -4:] = _as_bytes(values + layer)

    def check(
        self,
        request_id: str,
        block_ids: Sequence[int],
        fingerprints: Sequence[int],
        num_tokens: int,
    ) -> None:
        """Raise `KVMismatchError` unless positions `0..num_tokens-1` hold the prefix."""
        if num_tokens == 0:
            return
        blocks, offsets = self._slots(block_ids, 0, num_tokens)
        values = torch.tensor(fingerprints[:num_tokens], dtype=torch.int32)
        for layer, cache in enumerate(self._bytes):
            good = (cache[blocks, 0, offsets, :4] == _as_bytes(values ^ layer)).all(1) & (
                cache[blocks, -1, offsets, -4:] == _as_bytes(values + layer)
            ).all(1)
            if not bool(good.all()):
                pos = int((~good).nonzero()[0])
                raise KVMismatchError(
                    f"request {request_id}: position {pos} (block {int(blocks[pos])}, "
                    f"layer {layer}) holds KV of another prefix"
                )

    def _slots(
        self, block_ids: Sequence[int], start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[positions // self.block_size], positions % self.block_size


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    """Return int32 `values` as rows of their 4 bytes."""
    return values.contiguous().view(torch.int8).reshape(-1, 4)
