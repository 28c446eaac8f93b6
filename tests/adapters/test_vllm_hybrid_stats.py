"""Byte counters of a hybrid model count what one tier slot holds (SPEC §6.10 Beyond).

vLLM's KV cache groups share one allocation: a block id spans one page per layer of a
group, not every group's pages. The tier slot is sized that way (`bytes_per_slot`);
the byte counters (`bytes_stored`, `bytes_loaded`, `transfer_bytes`) counted the sum of
every group's page bytes instead, twice the bytes moved with two groups.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from kvtier_vllm import kvtier_harness, scheduler_side
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from kvtier.adapters.vllm.layout import bytes_per_slot
from kvtier.adapters.vllm.scheduler_side import SchedulerSide


def test_a_hybrid_models_byte_counters_count_one_slot_per_block() -> None:
    harness = kvtier_harness()
    try:
        config = scheduler_side(harness).offload.config
        spec = {"block_size": 16, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}
        groups = [
            KVCacheGroupSpec(["l0", "l2"], FullAttentionSpec(**spec)),
            KVCacheGroupSpec(["l1", "l3"], SlidingWindowSpec(**spec, sliding_window=64)),
        ]
        kv_cache_config = get_kv_cache_config_from_groups(harness.vllm_config, groups, 800 * 1024)
        kv_cache_config.hash_block_size = 16
        side = SchedulerSide(harness.vllm_config, kv_cache_config, config, [])
        side.bind_gpu_block_pool(harness.scheduler.kv_cache_manager.block_pool)
        slot = bytes_per_slot(kv_cache_config)
        assert side.layout.bytes_per_block == 2 * slot  # both groups' pages
        assert side.offload.bytes_per_slot == slot
        side.offload._counters.num_stored_blocks = 3  # as three completed stores count
        assert side.offload.take_stats().num_bytes_stored == 3 * slot
    finally:
        harness.close()
