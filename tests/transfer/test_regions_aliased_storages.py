"""Region discovery over storages that alias one memory (views built from a raw pointer:
`torch.frombuffer` on the CPU, DLPack imports on a GPU), checked by address, not storage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.transfer.regions import discover_regions

NB, BLOCK = 6, 64


def aliased_view(pool: np.ndarray, start: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Return a uint8 view of `pool` from byte `start`, in a storage of its own."""
    count = int(np.prod(shape))
    tensor = torch.frombuffer(pool, dtype=torch.uint8, offset=start, count=count)
    return tensor.view(shape)


def test_a_shifted_overlay_through_another_storage_is_rejected() -> None:
    """Regression: the same shifted overlay as in one storage (block b of one view is half
    of blocks b and b+1 of the other) was accepted when the second view had a storage of
    its own starting inside the first: a load into block b then overwrote half of block
    b+1, a block the job never named."""
    pool = np.zeros((NB + 1) * BLOCK, dtype=np.uint8)
    a = aliased_view(pool, 0, (NB, BLOCK))
    b = aliased_view(pool, BLOCK // 2, (NB, BLOCK))
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="under different block ids: block"):
        discover_regions([a, b])


def test_a_different_geometry_through_another_storage_is_rejected() -> None:
    """Block i of the second view is half of block i // 2 of the first."""
    pool = np.zeros(NB * BLOCK + BLOCK, dtype=np.uint8)
    a = aliased_view(pool, 0, (NB, BLOCK))
    b = aliased_view(pool, BLOCK, (NB, BLOCK // 2))
    with pytest.raises(ValueError, match="under different block ids: block"):
        discover_regions([a, b])


def test_disjoint_views_of_one_pool_in_several_storages_are_accepted() -> None:
    """Per-layer views cut from one pool, each in its own storage, share no byte."""
    pool = np.zeros(3 * NB * BLOCK, dtype=np.uint8)
    layers = [aliased_view(pool, i * NB * BLOCK, (NB, BLOCK)) for i in range(3)]
    regions = discover_regions(layers)
    assert len(regions.regions) == 3
    assert regions.bytes_per_slot == 3 * BLOCK


def test_a_consistent_overlay_through_another_storage_still_round_trips() -> None:
    """The V halves of a `[blocks, 2, ...]` cache imported again in a storage of their own
    map every shared byte to the same block id: accepted (stored twice), and a load of
    one block writes that block only."""
    pool = np.zeros(NB * BLOCK, dtype=np.uint8)
    cache = aliased_view(pool, 0, (NB, 2, BLOCK // 2))
    halves = aliased_view(pool, BLOCK // 2, (NB * BLOCK - BLOCK // 2,))
    values = halves.as_strided((NB, BLOCK // 2), (BLOCK, 1))
    regions = discover_regions([cache, values])
    pool[:] = np.random.default_rng(0).integers(0, 256, pool.shape, dtype=np.uint8)
    before = cache.clone()
    slot_rows = [view[1].clone() for view in regions.block_views()]
    for view, row in zip(regions.block_views(), slot_rows, strict=True):
        view[4].copy_(row)  # load block 1's slot into block 4
    assert torch.equal(cache[4], before[1])
    untouched = [b for b in range(NB) if b != 4]
    assert torch.equal(cache[untouched], before[untouched])


@pytest.mark.parametrize("layer_first", [False, True])
def test_storages_starting_at_one_address_merge_whatever_their_order(layer_first: bool) -> None:
    """Regression: two storages at one address (a whole packed `[blocks, layers, ...]`
    pool and its layer 0, each imported on its own) shared the first one's storage as
    the base of their regions; with the smaller one first, the merged region was refused
    as running past the end of its storage, though both views are valid."""
    layers = 3
    pool = np.zeros(NB * layers * BLOCK, dtype=np.uint8)
    whole = aliased_view(pool, 0, (NB, layers, BLOCK))
    layer0 = aliased_view(pool, 0, ((NB - 1) * layers * BLOCK + BLOCK,))
    layer0 = layer0.as_strided((NB, BLOCK), (layers * BLOCK, 1))
    assert whole.untyped_storage().data_ptr() == layer0.untyped_storage().data_ptr()
    regions = discover_regions([layer0, whole] if layer_first else [whole, layer0])
    assert len(regions.regions) == 1
    assert regions.bytes_per_slot == layers * BLOCK
    pool[:] = np.random.default_rng(1).integers(0, 256, pool.shape, dtype=np.uint8)
    assert torch.equal(regions.block_views()[0], whole.reshape(NB, -1))
