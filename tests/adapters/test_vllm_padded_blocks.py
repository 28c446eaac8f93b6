"""Tier slots of a KV allocation whose blocks vLLM pads past their pages.

With a block-outermost layout vLLM rounds a block up to every layer's
`block_stride_alignment`, so a block id spans more bytes than its pages; the worker's
tier slot holds only the pages (its regions). Regressions, all from sizing by the bytes a
block id spans: the direct-I/O check passed a 17000-byte slot (the block spans 20480 B)
and the worker failed in `register_kv_caches` naming no config key; the tiers held ~17%
fewer slots than the budget allows; and under pipeline parallelism a padded stage was
refused as larger than its layers' pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from block_span import bytes_per_block_id
from kvtier_vllm import kvtier_harness
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from kvtier.adapters.vllm.layout import tier_sizes
from kvtier.adapters.vllm.scheduler_side import SchedulerSide
from kvtier.adapters.vllm.worker_side import WorkerSide
from kvtier.offload.config import ConfigError, DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier

LAYOUT = "BLHNC"  # block-outermost: vLLM pads each block to the alignment
NUM_BLOCKS = 16
STATE_BYTES = 17000  # one Mamba state page
ATTENTION = {"block_size": 16, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}


@pytest.fixture(scope="module")
def vllm_config() -> Iterator[Any]:
    harness = kvtier_harness()
    try:
        harness.vllm_config.cache_config.kv_cache_layout = LAYOUT
        harness.vllm_config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        yield harness.vllm_config
    finally:
        harness.close()


def planned(vllm_config: Any, groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    """Plan the KV cache as vLLM's engine core does (one allocation, groups aliased)."""
    config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 30)
    assert config.num_blocks == NUM_BLOCKS
    config.kv_cache_layout = LAYOUT
    config.hash_block_size = 16
    return config


def hybrid(vllm_config: Any) -> KVCacheConfig:
    """A Mamba state of 17000 B beside full attention whose blocks align to 4096 B."""
    attention = FullAttentionSpec(**ATTENTION, block_stride_alignment=4096)
    state = MambaSpec(block_size=16, shapes=((STATE_BYTES,),), dtypes=(torch.uint8,))
    groups = [KVCacheGroupSpec(["attn.0"], attention), KVCacheGroupSpec(["ssm.1"], state)]
    config = planned(vllm_config, groups)
    assert bytes_per_block_id(config) == 5 * 4096  # the padded block, not the slot
    return config


def registered(config: KVCacheConfig, offload: OffloadConfig) -> WorkerSide:
    side = WorkerSide(config, offload, LAYOUT, ())
    buffer = torch.zeros(int(config.kv_cache_tensors[0].size), dtype=torch.uint8)
    side.register_kv_caches({name: buffer for t in config.kv_cache_tensors for name in t.layers})
    return side


def test_direct_io_checks_the_slot_at_start_up_naming_the_key(
    vllm_config: Any, tmp_path: Path
) -> None:
    config = hybrid(vllm_config)
    direct = OffloadConfig(disk_bytes=64 * 20480, disk_path=str(tmp_path))
    with pytest.raises(ConfigError, match=f'{STATE_BYTES} B.*"disk_io_mode": "page_cache"'):
        WorkerSide(config, direct, LAYOUT, ())
    with pytest.raises(ConfigError, match='"disk_io_mode": "page_cache"'):
        tier_sizes(direct, config)  # the scheduler role's sizing


def test_tiers_hold_as_many_slots_as_the_budget_allows(vllm_config: Any, tmp_path: Path) -> None:
    config = hybrid(vllm_config)
    offload = OffloadConfig(
        cpu_bytes=50 * STATE_BYTES,
        disk_bytes=100 * STATE_BYTES,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
    )
    expected = {Tier.CPU: 50, Tier.DISK: 100}
    assert tier_sizes(offload, config) == expected  # the scheduler role's
    side = registered(config, offload)
    try:
        assert side.tier_sizes == expected
        assert side.worker.bytes_per_slot == STATE_BYTES
    finally:
        side.worker.shutdown()


def test_a_padded_pipeline_stage_is_sized_by_its_pages(vllm_config: Any) -> None:
    """Three 2048-byte pages in a block padded to 8192 B: within 3 layers' pages."""
    spec = FullAttentionSpec(**ATTENTION, block_stride_alignment=4096)
    config = planned(vllm_config, [KVCacheGroupSpec(["l0", "l1", "l2"], spec)])
    assert bytes_per_block_id(config) == 8192
    budget = OffloadConfig(cpu_bytes=60 * 3 * 2048)
    assert tier_sizes(budget, config, (3, 2)) == {Tier.CPU: 60}
    side = SchedulerSide(vllm_config, config, budget, (3, 2))
    assert side.tier_sizes == {Tier.CPU: 60}
    assert side.offload.bytes_per_slot == 3 * 2048  # its byte counters count slots
