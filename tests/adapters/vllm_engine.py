"""vLLM engine pieces for the test harness: a tiny model, configs, a fake KV cache.

Test helper only (see `vllm_harness`). `build_scheduler` builds a real vLLM `Scheduler`
and its scheduler-role connector on CPU from a `HarnessConfig`; `FakeKVCache` is the
"GPU" KV cache of one rank (fake_kv_cache.py), holding a fingerprint of each position's
token prefix.
`HarnessConfig.kv_groups` makes the model hybrid: several KV cache groups (full
attention, sliding windows, Mamba states in vLLM's "align" cache mode), each with its
own block size, sharing one allocation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from fake_drafter import EagleStandIn
from fake_kv_cache import FakeKVCache, KVMismatchError, PrefixFingerprints
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.kv_cache_planning import (
    estimate_max_model_len,
    get_kv_cache_config_from_groups,
)
from vllm.v1.core.kv_cache_utils import (
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.structured_output import StructuredOutputManager

SIMPLE_CPU_OFFLOAD = "SimpleCPUOffloadConnector"
__all__ = ["FakeKVCache", "KVMismatchError", "PrefixFingerprints"]  # re-exported


@dataclass(frozen=True)
class KVGroupDef:
    """One KV cache group of a hybrid model: block size, and sliding window (None: full).

    `mamba`: a Mamba (SSM) state group in vLLM's "align" cache mode instead: its block
    holds one state, of the last token computed into it (fake_kv_cache.py), so a full
    block `j` holds the state after token `(j + 1) * block_size - 1`.
    """

    block_size: int = 16
    sliding_window: int | None = None
    mamba: bool = False

    def __post_init__(self) -> None:
        if self.mamba and self.sliding_window is not None:
            raise ValueError("a Mamba group has no sliding window")


@dataclass(frozen=True)
class HarnessConfig:
    """One engine: the tiny model, cache geometry, scheduler limits and connector.

    `connector` is the `kv_connector` class name (None: no connector); with
    `connector_module` it is loaded from that module, otherwise from vLLM's registry.
    `num_gpu_blocks` counts the null block; `max_model_len` is lowered to what they hold
    (vLLM's auto-fit: it refuses to start when one request of that length cannot fit, and
    its scheduler readmits a preempted request only when its whole sequence fits).
    `kv_cache_layout` is a `KVCacheLayout` name
    (LBNHC: layer-outermost, vLLM's usual; BLNHC: block-outermost). `num_ranks` is the
    tensor-parallel size: the world size connectors see, and one fake worker per rank.
    `kv_load_failure_policy` is vLLM's: "fail" (its default) or "recompute".
    `async_scheduling` is vLLM's flag (its default in 0.33; off here): the harness builds
    an `AsyncScheduler`, whose sampled tokens are placeholders until the step's output is
    processed. `batch_queue_size` is the steps in flight at once, as in vLLM's engine
    core (2 under asynchronous scheduling): the harness schedules step N+1 before it
    processes step N's output. 1 runs lock-step; more needs `async_scheduling`.
    `kv_role` is vLLM's. `scheduling_policy` is vLLM's: "fcfs" (its default) or "priority"
    (waiting requests ordered by `Request.priority`, lower first, then arrival; a running
    request that lacks blocks preempts the lowest-priority running one).
    `long_prefill_token_threshold` is vLLM's: while more than one request is eligible, a
    prefill chunk takes at most that many tokens (0: no cap). `kv_groups`
    (empty: one full-attention group of `block_size`) makes the model hybrid: one group
    per entry, `num_layers` layers each, the KV heads scaled so that every group's page
    has the same size (vLLM's shared allocation needs it); `block_size` is then the
    smallest group's. A Mamba group (`KVGroupDef.mamba`) turns on vLLM's "align" cache
    mode; its block size must be `block_size`, where vLLM's scheduler ends the prefill
    chunks of that mode. `prefix_match_unit` is vLLM's (None: `block_size`): the hash
    block size, finer than the groups' blocks (a hybrid model's large blocks with
    `--prefix-match-unit`); with a Mamba group vLLM then keeps the state at the prompt's
    last hash boundary inside a block (a "partial tail") and copies it aside when the
    request goes on (`kv_cache_block_copies`, which the harness runs before a forward).
    `eagle` gives vLLM an EAGLE speculative config
    (`EagleStandIn`: no drafter runs) so its scheduler and KV cache manager drop the last
    block of prefix hits and, in a Mamba group, keep the state where such a hit ends; the
    fake runner rejects every draft position vLLM schedules (synchronous scheduling only).
    `drafts` (needs `eagle`; 0: none) runs a fake drafter (fake_drafter.py): that many
    draft tokens per decoding request, a mix seeded by `draft_seed` of right and wrong
    ones, whose KV the forward writes and which it accepts as vLLM's rejection sampler;
    also under asynchronous scheduling (`batch_queue_size` at most 2), where vLLM
    schedules placeholders that the runner fills, correcting positions as vLLM's does.
    `max_loras` (0: LoRA off) turns on vLLM's LoRA support (`LoRAConfig`): its scheduler
    then runs requests of at most that many adapters in one step.
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
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    kv_groups: tuple[KVGroupDef, ...] = ()
    eagle: bool = False
    drafts: int = 0
    draft_seed: int = 0
    max_loras: int = 0
    prefix_match_unit: int | None = None

    def __post_init__(self) -> None:
        if self.batch_queue_size > 1 and not self.async_scheduling:
            raise ValueError("overlapping steps need async_scheduling, as in vLLM")
        if (
            self.eagle
            and self.async_scheduling
            and not (self.drafts and self.batch_queue_size <= 2)
        ):
            # Without drafts its fake runner rejects every draft position vLLM schedules,
            # which under asynchronous scheduling are placeholders the runner fills; with
            # a third step in flight vLLM's runner would correct its positions for one.
            raise ValueError("EAGLE under async scheduling needs drafts, <= 2 steps in flight")
        if self.drafts and (not self.eagle or self.has_mamba):
            raise ValueError("drafts need eagle and no Mamba group (states are not modelled)")
        if self.kv_groups and self.block_size != min(g.block_size for g in self.kv_groups):
            raise ValueError("block_size must be the smallest group's block size")
        if any(g.mamba and g.block_size != self.block_size for g in self.kv_groups):
            raise ValueError("a Mamba group's block size must be block_size (align mode)")
        unit = self.prefix_match_unit
        if unit is not None and (not self.kv_groups or self.block_size % unit):
            raise ValueError("prefix_match_unit must divide block_size of a hybrid model")

    @property
    def hash_block_size(self) -> int:
        """Return the hash block size: `prefix_match_unit`, else `block_size`."""
        return self.prefix_match_unit or self.block_size

    @property
    def groups(self) -> tuple[KVGroupDef, ...]:
        """Return the KV cache groups: `kv_groups`, or one full-attention group."""
        return self.kv_groups or (KVGroupDef(self.block_size),)

    @property
    def group_layer_names(self) -> list[list[str]]:
        """Return each group's attention layer names (layers interleaved by group)."""
        n = len(self.groups)
        return [
            [f"model.layers.{i * n + g}.self_attn.attn" for i in range(self.num_layers)]
            for g in range(n)
        ]

    @property
    def layer_names(self) -> list[str]:
        """Return the attention layer names of every group."""
        return [name for names in self.group_layer_names for name in names]

    @property
    def attention_spec(self) -> FullAttentionSpec:
        """Return the one full-attention spec every layer shares (no `kv_groups`)."""
        return FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=torch.float16,
        )

    @property
    def has_mamba(self) -> bool:
        """Return True when a group holds Mamba states (vLLM's "align" cache mode)."""
        return any(group.mamba for group in self.groups)

    def group_spec(self, group: KVGroupDef) -> FullAttentionSpec | MambaSpec:
        """Return a group's spec, with the heads that keep its page `attention_spec`'s size.

        A Mamba group's page is two states (a conv and an SSM state, as Mamba2 keeps) that
        fill exactly that size.
        """
        if group.mamba:
            num_halves = self.attention_spec.page_size_bytes // 2  # float16 elements
            return MambaSpec(
                block_size=group.block_size,
                shapes=((num_halves // 4,), (num_halves - num_halves // 4,)),
                dtypes=(torch.float16, torch.float16),
                mamba_cache_mode="align",
            )
        heads, rest = divmod(self.num_kv_heads * self.block_size, group.block_size)
        if heads == 0 or rest:
            raise ValueError(f"no whole number of KV heads for {group}")
        common: dict[str, Any] = {
            "block_size": group.block_size,
            "num_kv_heads": heads,
            "head_size": self.head_size,
            "dtype": torch.float16,
        }
        if group.sliding_window is None:
            return FullAttentionSpec(**common)
        return SlidingWindowSpec(**common, sliding_window=group.sliding_window)


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
        "num_hidden_layers": len(cfg.layer_names),
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
        policy=cfg.scheduling_policy,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
    )
    cache_config = CacheConfig(
        block_size=cfg.block_size,
        enable_prefix_caching=True,
        mamba_cache_mode="align" if cfg.has_mamba else "none",
        prefix_match_unit=cfg.prefix_match_unit,
    )
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
        lora_config=LoRAConfig(max_loras=cfg.max_loras) if cfg.max_loras else None,
    )
    vllm_config.cache_config.num_gpu_blocks = cfg.num_gpu_blocks
    if cfg.eagle:
        object.__setattr__(
            vllm_config,
            "speculative_config",
            EagleStandIn(num_speculative_tokens=max(1, cfg.drafts)),
        )
    # vLLM's CPU platform turns asynchronous scheduling off; the harness stands in for a
    # GPU engine, where it stays as configured (and makes the scheduler defer block
    # frees for a KV consumer, `max_concurrent_batches` being 2).
    vllm_config.scheduler_config.async_scheduling = cfg.async_scheduling
    return vllm_config


def build_kv_cache_config(cfg: HarnessConfig, vllm_config: VllmConfig) -> KVCacheConfig:
    """Plan the KV cache the way the engine core does: one allocation, the groups share it."""
    vllm_config.cache_config.kv_cache_layout = cfg.kv_cache_layout
    vllm_config.cache_config.num_gpu_blocks_override = cfg.num_gpu_blocks
    groups = [
        KVCacheGroupSpec(names, cfg.group_spec(group))
        for names, group in zip(cfg.group_layer_names, cfg.groups, strict=True)
    ]
    bytes_per_block = cfg.num_layers * cfg.attention_spec.page_size_bytes
    config = get_kv_cache_config_from_groups(
        vllm_config, groups, cfg.num_gpu_blocks * bytes_per_block
    )
    assert config.num_blocks == cfg.num_gpu_blocks
    specs = {name: group.kv_cache_spec for group in groups for name in group.layer_names}
    usable = (cfg.num_gpu_blocks - 1) * bytes_per_block  # less vLLM's null block
    model_config = vllm_config.model_config
    model_config.max_model_len = min(
        model_config.max_model_len, estimate_max_model_len(vllm_config, specs, usable)
    )
    # The engine core resolves these before building the scheduler.
    config.kv_cache_layout = cfg.kv_cache_layout
    config.hash_block_size = cfg.hash_block_size
    config.cache_hit_alignment_tokens = cfg.block_size
    if cfg.kv_groups:
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(config, vllm_config)
        assert hash_block_size == cfg.hash_block_size, (hash_block_size, cfg.hash_block_size)
        config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            config, vllm_config, scheduler_block_size, hash_block_size
        )
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
    scheduler_block_size = cfg.block_size
    if cfg.kv_groups:
        scheduler_block_size, _ = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    register_all_kvcache_specs(vllm_config)
    scheduler_cls = AsyncScheduler if cfg.async_scheduling else Scheduler
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=cfg.hash_block_size,
        log_stats=True,
    )
    return scheduler, vllm_config, kv_cache_config
