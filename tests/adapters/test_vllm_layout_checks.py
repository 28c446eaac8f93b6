"""`layout`'s start-up checks and defaults on vLLM's own config classes: the hash block
size a layout takes, HiSparse host groups outside KV transfer, the scheduler role's view
of a merged group, and the errors sizing raises."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

import torch
from test_vllm_slot_bytes import BUDGET, NUM_BLOCKS, one_layer_config, planned, spec
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from kvtier.adapters.vllm.layout import (
    UnsupportedLayoutError,
    bytes_per_slot,
    check_scheduler_agrees,
    kv_layout,
    num_tier_blocks,
    stage_slot_bytes,
    tier_sizes,
)
from kvtier.adapters.vllm.worker_side import WorkerSide
from kvtier.offload.config import DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier


def test_a_layout_hashes_at_the_engine_s_hash_block_size_unless_given_one() -> None:
    """The engine core resolves `hash_block_size` (here 8 tokens of a 16-token block): a
    layout hashing every block instead would never match `Request.block_hashes`."""
    config = dataclasses.replace(one_layer_config(), hash_block_size=8)
    assert kv_layout(config).hash_block_size == 8
    assert kv_layout(config, 4).hash_block_size == 4


def with_host_group(enable_kv_transfer: bool) -> KVCacheConfig:
    """`one_layer_config` (2048-byte pages) behind a HiSparse host group of 4096-byte ones."""
    device = one_layer_config()
    host_page = spec(4).page_size_bytes
    host = KVCacheTensor(64 * host_page, ["src"], 64 * host_page, host_page, 0, True)
    host_group = KVCacheGroupSpec(
        ["src"], spec(4), host_resident=True, enable_kv_transfer=enable_kv_transfer
    )
    return KVCacheConfig(
        NUM_BLOCKS,
        [host, *device.kv_cache_tensors],
        [host_group, *device.kv_cache_groups],
        hisparse_host_num_blocks=64,
    )


def test_a_host_group_outside_kv_transfer_is_served_and_left_out_of_slots() -> None:
    """A host-resident group that takes no part in KV transfer is never copied by block
    id: start-up accepts it, and neither tier slots nor stage bounds count its pages."""
    config = with_host_group(enable_kv_transfer=False)
    assert tier_sizes(BUDGET, config) == {Tier.CPU: (1 << 20) // 2048}
    assert stage_slot_bytes(config, (2, 3)) == [2 * 2048, 3 * 2048]
    with pytest.raises(UnsupportedLayoutError, match="HiSparse"):
        tier_sizes(BUDGET, with_host_group(enable_kv_transfer=True))


def test_a_model_whose_groups_all_live_on_the_host_has_no_stage_bound() -> None:
    """Pipeline sizing needs a device page to bound a stage's slot by."""
    only_host = with_host_group(enable_kv_transfer=False)
    only_host.kv_cache_groups = only_host.kv_cache_groups[:1]
    with pytest.raises(UnsupportedLayoutError, match="no KV cache groups on the device"):
        stage_slot_bytes(only_host, (2, 3))


def test_a_scheduler_view_of_smaller_slots_is_refused_by_the_worker() -> None:
    """Layer-outermost pages of 3072 B (padded to 4096) and 4096 B: from the first
    layer's spec the scheduler reads both strides as padded 3072-byte pages, slots of
    6144 B where the worker's hold 7168 B; the worker refuses, as when the scheduler's
    slots are the larger."""
    specs = {
        name: FullAttentionSpec(
            block_size=16, num_kv_heads=h, head_size=16, dtype=torch.float16,
            block_stride_alignment=4096,
        )
        for name, h in (("a", 3), ("b", 4))
    }  # fmt: skip
    worker_config = planned("LBNHC", specs)
    assert bytes_per_slot(generate_scheduler_kv_cache_config([worker_config])) == 6144
    with pytest.raises(UnsupportedLayoutError, match=r"hold 7168 B.* of 6144 B"):
        WorkerSide(worker_config, BUDGET, "LBNHC", ())


def test_a_merged_group_beside_a_group_of_one_spec_is_checked_alike() -> None:
    """Only merged groups change in the scheduler's copy; a hybrid model's other groups
    pass as they are, and both roles size the same slots."""
    window = {
        "c": SlidingWindowSpec(
            block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64
        )
    }
    config = planned("BLHNC", {"a": spec(2), "b": spec(4)}, window)
    config.kv_cache_groups[1] = KVCacheGroupSpec(["c"], window["c"])  # not wrapped
    check_scheduler_agrees(config)
    scheduler_config = generate_scheduler_kv_cache_config([config])
    assert tier_sizes(BUDGET, config) == tier_sizes(BUDGET, scheduler_config)


def test_num_tier_blocks_sizes_the_first_lower_tier_of_a_cascade() -> None:
    cascade = OffloadConfig(
        cpu_bytes=2048 * 8,
        disk_bytes=2048 * 20,
        disk_path="/tmp",
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        num_blocks=5,
    )
    assert tier_sizes(cascade, one_layer_config()) == {Tier.CPU: 5, Tier.DISK: 20}
    assert num_tier_blocks(cascade, one_layer_config()) == 5


def test_a_placement_that_cannot_be_addressed_is_an_unsupported_layout() -> None:
    """Start-up reports a layout kvtier cannot serve as one error type, whichever module
    found it (a config placing nothing on the device, here)."""
    config = one_layer_config()
    config.kv_cache_tensors[0].host_resident = True
    with pytest.raises(UnsupportedLayoutError, match="places no tensor on the device"):
        bytes_per_slot(config)
