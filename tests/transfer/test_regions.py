"""Region discovery from engine KV tensors (SPEC §7 register)."""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import block_bytes, fill_random

from kvtier.transfer.regions import RegionSet, TensorLayout, discover_regions

NB = 6  # blocks


def expected_slot(parts: list[torch.Tensor], block_id: int) -> bytes:
    """Return the bytes of `block_id` as the concatenation of per-tensor block slices."""
    return b"".join(p[block_id].contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


def assert_addresses(regions: RegionSet, parts: list[torch.Tensor]) -> None:
    """Every block's slot image equals the concatenation of `parts[i][block]`."""
    for block_id in range(regions.num_blocks):
        assert block_bytes(regions, block_id) == expected_slot(parts, block_id)


def test_kv_first_per_layer_gives_k_and_v_regions() -> None:
    """[2, num_blocks, ...] per layer: two regions (K rows, V rows) per tensor."""
    kv = [torch.zeros(2, NB, 4, 2, 8, dtype=torch.float16) for _ in range(3)]
    fill_random(kv, seed=1)
    regions = discover_regions(kv, TensorLayout.KV_FIRST)
    assert len(regions.regions) == 6
    assert regions.num_blocks == NB
    assert regions.bytes_per_slot == 3 * 2 * 4 * 2 * 8 * 2
    assert [r.name for r in regions.regions[:2]] == ["kv[0][K]", "kv[0][V]"]
    assert_addresses(regions, [t[i] for t in kv for i in (0, 1)])


def test_blocks_first_layout_is_one_region_per_tensor() -> None:
    """[num_blocks, 2, ...] per layer (FlashInfer style): K and V of a block are adjacent."""
    kv = {f"layer{i}": torch.zeros(NB, 2, 4, 2, 8, dtype=torch.bfloat16) for i in range(2)}
    fill_random(list(kv.values()), seed=2)
    regions = discover_regions(kv)
    assert [r.name for r in regions.regions] == ["layer0", "layer1"]
    assert all(r.bytes_per_block == 2 * 4 * 2 * 8 * 2 for r in regions.regions)
    assert_addresses(regions, list(kv.values()))


def test_separate_k_and_v_tensors() -> None:
    """K and V in separate [num_blocks, block_size, heads, dim] tensors: one region each."""
    kv = [torch.zeros(NB, 4, 2, 8, dtype=torch.float32) for _ in range(4)]
    fill_random(kv, seed=3)
    regions = discover_regions(kv)
    assert len(regions.regions) == 4
    assert_addresses(regions, kv)


def test_packed_allocation_shared_by_layers_merges_into_one_region() -> None:
    """Per-layer views into one [num_blocks, layers, 2, ...] allocation merge into one region."""
    packed = torch.zeros(NB, 5, 2, 4, 8, dtype=torch.float16)
    fill_random([packed], seed=4)
    views = [packed[:, layer] for layer in range(5)]
    regions = discover_regions(views)
    assert len(regions.regions) == 1
    assert regions.bytes_per_slot == packed[0].nbytes
    assert "5 views" in regions.regions[0].name
    assert_addresses(regions, [packed])
    assert block_bytes(discover_regions([packed]), 3) == block_bytes(regions, 3)


def test_groups_overlaying_the_same_memory_are_deduplicated() -> None:
    """The same tensor under two names (two groups sharing memory) is copied once."""
    shared = torch.zeros(2, NB, 4, 2, 8, dtype=torch.float16)
    other = torch.zeros(2, NB, 4, 2, 8, dtype=torch.float16)
    alias = shared.view(torch.int16)  # another view of the same bytes
    regions = discover_regions(
        {"g0.l0": shared, "g1.l0": alias, "g0.l1": other}, TensorLayout.KV_FIRST
    )
    assert len(regions.regions) == 4
    assert regions.bytes_per_slot == 2 * shared[:, 0].nbytes


def test_regions_may_differ_in_bytes_per_block() -> None:
    """A slot concatenates regions of different widths (e.g. MLA + a state group)."""
    mla = torch.zeros(NB, 4, 24, dtype=torch.float16)
    state = torch.zeros(NB, 3, 40, dtype=torch.float32)
    fill_random([mla, state], seed=5)
    regions = discover_regions([mla, state])
    assert [r.bytes_per_block for r in regions.regions] == [4 * 24 * 2, 3 * 40 * 4]
    assert regions.slot_columns() == ((0, 192), (192, 672))
    assert_addresses(regions, [mla, state])


def test_permuted_inner_dims_are_still_one_dense_block() -> None:
    """An HND view of an NHD allocation: the block's bytes are dense, only permuted."""
    base = torch.zeros(2, NB, 2, 4, 8, dtype=torch.float16)  # physical [2, nb, heads, bs, dim]
    fill_random([base], seed=6)
    logical = base.permute(0, 1, 3, 2, 4)  # logical [2, nb, bs, heads, dim]
    regions = discover_regions([logical], TensorLayout.KV_FIRST)
    assert len(regions.regions) == 2
    assert_addresses(regions, [base[0], base[1]])


def test_auto_refuses_a_two_block_cache_it_would_read_as_kv_first() -> None:
    """Regression: AUTO read [2 blocks, block_size, ...] as [2 (K, V), block_size blocks,
    ...]: registration succeeded and every block's copy took a row of each real block."""
    cache = torch.zeros(2, 16, 2, 8, dtype=torch.float16)  # blocks first, 2 blocks
    with pytest.raises(ValueError, match=r"\(2, 16, 2, 8\): TensorLayout.AUTO cannot tell"):
        discover_regions({"layer.0": cache})
    regions = discover_regions([cache], TensorLayout.BLOCKS_FIRST)
    assert (regions.num_blocks, len(regions.regions)) == (2, 1)
    regions = discover_regions([cache], TensorLayout.KV_FIRST)
    assert (regions.num_blocks, len(regions.regions)) == (16, 2)


def test_auto_reads_unambiguous_shapes_as_blocks_first() -> None:
    for shape in [(2, 8), (3, 2, 8), (NB, 2, 4)]:
        regions = discover_regions([torch.zeros(shape)])
        assert (regions.num_blocks, len(regions.regions)) == (shape[0], 1)


def test_region_views_alias_engine_memory() -> None:
    """Writing through a region view changes the engine tensor (no copies)."""
    kv = torch.zeros(2, NB, 4, dtype=torch.float32)
    regions = discover_regions([kv], TensorLayout.KV_FIRST)
    regions.block_views()[1][2].fill_(0xFF)  # V of block 2
    assert torch.isnan(kv[1, 2]).all()
    assert not torch.isnan(kv[0]).any()


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([torch.zeros(NB, 4, 8)[:, :, ::2]], "not contiguous"),
        ([torch.zeros(NB, 4, 8), torch.zeros(NB + 1, 4, 8)], "disagree on the number of blocks"),
        ([torch.zeros(16)], "at least"),
        ([torch.zeros(NB, 0, 4)], "zero-sized"),
        ([], "no KV tensors"),
        ([torch.zeros(64).as_strided((NB, 16), (8, 1))], "block stride"),
    ],
)
def test_unaddressable_layouts_are_rejected(tensors: list[torch.Tensor], message: str) -> None:
    """Layouts that cannot be copied block by block fail with a message naming the problem."""
    with pytest.raises(ValueError, match=message):
        discover_regions(tensors)


def test_overlay_with_different_geometry_is_rejected() -> None:
    """Two views mapping the same bytes to different block ids cannot be addressed."""
    flat = torch.zeros(NB * 64, dtype=torch.uint8)
    a = flat.view(NB, 64)
    b = flat.view(NB * 2, 32)[:NB]  # block i of b is half of block i // 2 of a
    with pytest.raises(ValueError, match="under different block ids: block"):
        discover_regions([a, b])


def test_views_of_different_block_counts_are_told_so_before_any_overlay() -> None:
    """Regression: views of one memory that disagree on the number of blocks were reported
    as an overlay of different block ids, which hid the plainer mistake."""
    flat = torch.zeros(NB * 64, dtype=torch.uint8)
    whole, halves = flat.view(NB, 64), flat.view(NB * 2, 32)
    with pytest.raises(ValueError, match="disagree on the number of blocks"):
        discover_regions([whole, halves])


def test_shifted_overlay_is_rejected() -> None:
    """Same stride but shifted by half a block: block b of one overlaps block b+1 of the other."""
    flat = torch.zeros((NB + 1) * 64, dtype=torch.uint8)
    a = flat[: NB * 64].view(NB, 64)
    b = flat[32 : 32 + NB * 64].view(NB, 64)
    with pytest.raises(ValueError, match="under different block ids: block"):
        discover_regions([a, b])


def test_wrong_explicit_layout_and_non_tensors_are_rejected() -> None:
    """KV_FIRST on a tensor without a leading 2 or with 2 dims only (regression: that one
    was told it was "not [2, ...]"), and a non-tensor, name the culprit."""
    first_dim = (
        r"\(3, 6, 4\): TensorLayout.KV_FIRST needs \[2 \(K, V\), num_blocks, \.\.\.\], got 3"
    )
    with pytest.raises(ValueError, match=first_dim):
        discover_regions({"odd": torch.zeros(3, NB, 4)}, TensorLayout.KV_FIRST)
    with pytest.raises(ValueError, match=r"'kv' has shape \(2, 8\): TensorLayout.KV_FIRST needs"):
        discover_regions({"kv": torch.zeros(2, 8)}, TensorLayout.KV_FIRST)  # 2 dims, not 3
    with pytest.raises(ValueError, match=r"\(2,\): TensorLayout.KV_FIRST needs at least 3 dims"):
        discover_regions({"kv": torch.zeros(2)}, TensorLayout.KV_FIRST)
    with pytest.raises(TypeError, match="'x' is a list"):
        discover_regions({"x": [1, 2]})  # type: ignore[dict-item]


@pytest.mark.parametrize("layout", ["kv_first", "auto", None])
def test_a_layout_that_is_not_a_tensor_layout_is_rejected(layout: object) -> None:
    """Regression: layout="kv_first" (a string) was read as BLOCKS_FIRST, so a
    `[2, num_blocks, ...]` cache became 2 "blocks" each spanning all of K or all of V."""
    with pytest.raises(ValueError, match=f"layout must be a TensorLayout, got {layout!r}"):
        discover_regions([torch.zeros(2, NB, 4)], layout)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(NB, 8, device="meta"), r"'kv\[0\]' is on meta: need a cpu or cuda"),
        (torch.zeros(NB, 8).to_sparse(), r"'kv\[0\]' has layout torch.sparse_coo"),
    ],
)
def test_tensors_without_addressable_bytes_are_rejected(tensor: torch.Tensor, message: str) -> None:
    """Regression: a meta tensor was accepted (every job then failed) and a sparse one gave a
    bare NotImplementedError; both now fail up front naming the tensor."""
    with pytest.raises(ValueError, match=message):
        discover_regions([tensor])


def test_auto_refuses_a_shape_that_reads_both_ways() -> None:
    """Regression: [2 blocks, 2 (K, V), ...] was read as [2 (K, V), 2 blocks, ...]."""
    cache = torch.zeros(2, 2, 4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"AUTO cannot tell K/V from blocks; pass layout="):
        discover_regions({"layer.0": cache})
    assert discover_regions([cache], TensorLayout.BLOCKS_FIRST).num_blocks == 2
    assert discover_regions([cache], TensorLayout.KV_FIRST).num_blocks == 2
