"""Region discovery: the order of a slot's regions, and inputs it must refuse rather
than read as something else.

Each test here was written against a mutant that passed every older test (s33 mutation
run on `transfer/regions.py`).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.transfer.regions import discover_regions


def test_regions_follow_the_order_their_tensors_are_given() -> None:
    """A slot holds the regions in the order the engine gave their tensors (their first
    view, for merged ones), not in address order: two layers of one storage given last
    first keep that order."""
    storage = torch.zeros(8, 3, 16)  # 8 blocks of three 16-float rows, a gap between
    layer0, layer1 = storage[:, 0], storage[:, 2]
    regions = discover_regions({"layer.1": layer1, "layer.0": layer0})
    assert [r.name for r in regions.regions] == ["layer.1", "layer.0"]
    assert regions.slot_columns() == ((0, 64), (64, 128))


def test_a_merged_region_takes_the_place_of_its_first_view() -> None:
    """K and V halves of one storage given around another storage's tensor merge into
    one region, which comes first, where its first half was given."""
    packed = torch.zeros(8, 2, 16)  # [blocks, K/V, ...]: the halves touch
    other = torch.zeros(8, 32)
    regions = discover_regions({"k": packed[:, 0], "other": other, "v": packed[:, 1]})
    assert [r.name for r in regions.regions] == ["k..v (2 views)", "other"]


def test_one_tensor_is_refused_not_iterated() -> None:
    """A bare tensor in place of a list would iterate over its first dim: each block (or
    K and V) taken for a layer's cache."""
    with pytest.raises(TypeError, match=r"kv_tensors is one tensor of shape \(2, 8, 4\)"):
        discover_regions(torch.zeros(2, 8, 4))  # type: ignore[arg-type]


def test_auto_refuses_a_three_dim_cache_with_two_in_front() -> None:
    """[2, n, x] reads as K/V of n blocks or as 2 blocks: AUTO refuses it (3 dims are
    enough for KV_FIRST)."""
    with pytest.raises(ValueError, match=r"\(2, 8, 4\): TensorLayout.AUTO cannot tell"):
        discover_regions([torch.zeros(2, 8, 4)])


def test_views_of_one_stride_that_disagree_on_blocks_are_not_merged() -> None:
    """Two views of one storage with one block stride, touching in the block, but one
    of 8 blocks and one of 6: merged, the region would claim 8 blocks of both."""
    storage = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="disagree on the number of blocks"):
        discover_regions({"a": storage[:, :8], "b": storage[:6, 8:]})
