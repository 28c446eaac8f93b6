"""`regions`' reading of vLLM's KV placement at its edges, without vLLM (the stand-ins of
test_vllm_pure.py): one block, bytes before the allocation, layers no group names,
placements in HiSparse's host pool."""

from __future__ import annotations

import pytest
import torch
from test_vllm_pure import FullAttentionSpec, group, kv_config, layered_cache, placement

from kvtier.adapters.vllm.regions import (
    PlacementError,
    layer_page_bytes,
    placement_block_views,
    placement_slot_bytes,
)


def test_one_block_s_view_ignores_its_block_stride() -> None:
    """With one block no page follows another, so a stride under the page overlaps
    nothing (as region discovery ignores it)."""
    config, tensors, _ = layered_cache("LBNHC", num_blocks=1)
    config.kv_cache_tensors[0].block_stride = 32
    views = placement_block_views(config, tensors, "LBNHC")
    for name, view in views.items():
        assert torch.equal(view, tensors[name].view(torch.uint8))


def test_a_layer_handed_a_list_of_tensors_has_no_start_to_check() -> None:
    """vLLM hands a state layer a list of tensors: their views do not start at the
    page, so only the placement says where the layer's bytes are."""
    config, tensors, _ = layered_cache("LBNHC")
    as_list = dict(tensors, l1=[tensors["l1"][:, :16], tensors["l1"][:, 16:]])
    views = placement_block_views(config, as_list, "LBNHC")
    assert torch.equal(views["l1"], tensors["l1"].view(torch.uint8))


def test_a_placement_starting_before_the_allocation_is_refused() -> None:
    config, tensors, _ = layered_cache("LBNHC")
    config.kv_cache_tensors[0].offset = -64
    with pytest.raises(PlacementError, match=r"'l0': bytes \[-64, 448\) lie outside"):
        placement_block_views(config, tensors, "LBNHC")


def test_a_placed_layer_of_no_kv_group_is_refused() -> None:
    """Its page size is unknown: a slot sized without it would not hold its bytes."""
    config, tensors, _ = layered_cache("LBNHC")
    config.kv_cache_groups[0].layer_names = ["l0"]
    with pytest.raises(PlacementError, match="'l1' is placed but belongs to no KV group"):
        placement_slot_bytes(config)
    with pytest.raises(PlacementError, match="'l1' is placed but belongs to no KV group"):
        placement_block_views(config, tensors, "LBNHC")


def test_host_resident_placements_hold_no_slot_bytes_and_get_no_view() -> None:
    """HiSparse's host pool is outside the device allocation the worker copies."""
    config, tensors, _ = layered_cache("LBNHC")
    host = placement(["h"], 64, 64, 8 * 64)
    host.host_resident = True
    config.kv_cache_tensors.append(host)
    config.kv_cache_groups.append(group(["h"], FullAttentionSpec(page_size_bytes=64)))
    assert placement_slot_bytes(config) == 2 * 64
    assert set(placement_block_views(config, tensors, "LBNHC")) == {"l0", "l1"}


def test_a_host_resident_layer_s_page_is_its_spec_s_not_its_host_stride() -> None:
    """The host pool strides its blocks its own way (here 128 B apart, layer-outermost
    as the device's would be): that stride says nothing of the layer's 64-byte page."""
    config, _, _ = layered_cache("LBNHC")
    host = placement(["h"], 8 * 128, 128, 8 * 128)
    host.host_resident = True
    config.kv_cache_tensors.append(host)
    config.kv_cache_groups.append(group(["h"], FullAttentionSpec(page_size_bytes=64)))
    assert layer_page_bytes(config) == {"l0": 64, "l1": 64, "h": 64}


def test_a_config_placing_nothing_on_the_device_is_refused() -> None:
    host = placement(["h"], 64, 64, 8 * 64)
    host.host_resident = True
    config = kv_config([group(["h"], FullAttentionSpec(page_size_bytes=64))], [host])
    with pytest.raises(PlacementError, match="places no tensor on the device"):
        placement_slot_bytes(config)


def test_a_layer_s_page_is_read_from_strides_only_where_vllm_s_planner_sets_them() -> None:
    """The scheduler's copy of a merged group states one layer's page (here 1024 B); a
    placement whose layers fill a block exactly (layer stride 2048 B, one layer per
    2048-byte block) holds 2048-byte pages. Without strides the stated page stands."""
    packed = placement(["b"], 2048, 2048, 8 * 2048)
    config = kv_config([group(["b"], FullAttentionSpec(page_size_bytes=1024))], [packed])
    assert layer_page_bytes(config) == {"b": 2048}
    packed.layer_stride = packed.block_stride = 0
    assert layer_page_bytes(config) == {"b": 1024}
