"""The bytes of a tier slot: the same in the scheduler role's sizing and the worker's regions.

Regressions: a `UniformTypeKVCacheSpecs` group (layers of one kind, different page
sizes) reaches vLLM's scheduler as one of its layers' specs, so the scheduler role sized
the tiers for 256 slots while the worker held 170 (slots past the worker's tier); and
nothing checked that the worker's registered regions hold the bytes its tiers were
sized for.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)

from kvtier.adapters.vllm import layout
from kvtier.adapters.vllm.layout import UnsupportedLayoutError, bytes_per_slot, tier_sizes
from kvtier.adapters.vllm.worker_side import WorkerSide
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier

LAYOUT = "LBNHC"
NUM_BLOCKS = 16
BUDGET = OffloadConfig(cpu_bytes=1 << 20)


def spec(num_kv_heads: int, head_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float16
    )


def one_layer_config() -> KVCacheConfig:
    """One full-attention layer of 2048-byte pages, as vLLM's planner places it."""
    page = spec(2).page_size_bytes
    tensor = KVCacheTensor(NUM_BLOCKS * page, ["a"], NUM_BLOCKS * page, page, 0)
    return KVCacheConfig(NUM_BLOCKS, [tensor], [KVCacheGroupSpec(["a"], spec(2))])


def uniform_config() -> KVCacheConfig:
    """Layers "a" (2048-byte pages) and "b" (4096) in one group, placed as vLLM's planner
    places them with a layer-outermost layout (`get_kv_cache_config_from_groups`)."""
    specs = {"a": spec(2), "b": spec(4)}
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None
    size = NUM_BLOCKS * (2048 + 4096)
    tensors = [
        KVCacheTensor(size, ["a"], NUM_BLOCKS * 2048, 2048, 0),
        KVCacheTensor(size, ["b"], NUM_BLOCKS * 4096, 4096, NUM_BLOCKS * 2048),
    ]
    return KVCacheConfig(NUM_BLOCKS, tensors, [KVCacheGroupSpec(["a", "b"], uniform)])


def registered_side(config: KVCacheConfig) -> WorkerSide:
    side = WorkerSide(config, BUDGET, LAYOUT, ())
    buffer = torch.zeros(max(int(t.size) for t in config.kv_cache_tensors), dtype=torch.uint8)
    side.register_kv_caches({name: buffer for t in config.kv_cache_tensors for name in t.layers})
    return side


def test_the_worker_registers_the_slot_bytes_its_tiers_were_sized_for() -> None:
    side = registered_side(one_layer_config())
    try:
        assert side.worker.bytes_per_slot == bytes_per_slot(one_layer_config()) == 2048
    finally:
        side.worker.shutdown()


def test_register_refuses_regions_of_other_slot_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizing and regions are two computations of one number; were they ever to drift,
    the worker must refuse rather than hold tiers of another size than planned."""
    real = layout.placement_slot_bytes
    monkeypatch.setattr(layout, "placement_slot_bytes", lambda config: real(config) + 4096)
    with pytest.raises(RuntimeError, match=r"hold 2048 B per KV block id.*sized for 6144 B"):
        registered_side(one_layer_config())


def test_a_group_of_different_page_sizes_is_refused_by_the_worker() -> None:
    worker_config = uniform_config()
    scheduler_config = generate_scheduler_kv_cache_config([worker_config])  # vLLM's own
    assert tier_sizes(BUDGET, scheduler_config) == {Tier.CPU: (1 << 20) // (2 * 2048)}
    # The worker's slots hold 2048 + 4096 B: 170 slots, not the scheduler's 256.
    with pytest.raises(UnsupportedLayoutError, match=r"group 0 .* page sizes \[2048, 4096\]"):
        WorkerSide(worker_config, BUDGET, LAYOUT, ())


def test_a_group_of_one_page_size_is_sized_alike_in_both_roles() -> None:
    """Layers of equal pages but different head shapes: both roles' slots agree."""
    specs = {"a": spec(2), "b": spec(1, head_size=32)}
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None
    config = uniform_config()
    config.kv_cache_groups = [KVCacheGroupSpec(["a", "b"], uniform)]
    config.kv_cache_tensors[1] = KVCacheTensor(
        NUM_BLOCKS * 4096, ["b"], NUM_BLOCKS * 2048, 2048, NUM_BLOCKS * 2048
    )
    scheduler_config = generate_scheduler_kv_cache_config([config])
    assert tier_sizes(BUDGET, config) == tier_sizes(BUDGET, scheduler_config) == {Tier.CPU: 256}
