"""Overlaid regions over random views of one memory (SPEC §7 register): `discover_regions`
refuses a layout exactly when some byte lies in blocks of two different ids, whether the
views share one storage or each has a storage of its own aliasing the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.transfer.regions import discover_regions

View = tuple[int, int, int]  # (byte offset, block stride, bytes per block)


def block_owners(views: list[View], num_blocks: int) -> dict[int, set[int]]:
    """Return the block ids each byte of the views lies in: the brute-force reference."""
    owners: dict[int, set[int]] = {}
    for offset, stride, size in views:
        for block in range(num_blocks):
            start = offset + block * stride
            for byte in range(start, start + size):
                owners.setdefault(byte, set()).add(block)
    return owners


def make_views(
    views: list[View], num_blocks: int, own_storages: bool, pool: np.ndarray | None = None
) -> list[torch.Tensor]:
    """Return `[num_blocks, size]` uint8 views of a zeroed pool, in one storage or one each."""
    ends = [offset + (num_blocks - 1) * stride + size for offset, stride, size in views]
    pool = np.zeros(max(ends), dtype=np.uint8) if pool is None else pool
    tensors = []
    for (offset, stride, size), end in zip(views, ends, strict=True):
        if own_storages:  # a storage starting at the view's first byte (DLPack, frombuffer)
            flat = torch.frombuffer(pool, dtype=torch.uint8, offset=offset, count=end - offset)
            tensors.append(flat.as_strided((num_blocks, size), (stride, 1)))
        else:
            flat = torch.frombuffer(pool, dtype=torch.uint8)
            tensors.append(flat.as_strided((num_blocks, size), (stride, 1), offset))
    return tensors


@st.composite
def overlaid_views(draw: st.DrawFn) -> list[View]:
    """2-3 views with strides from a small set, so that equal strides are common."""
    views = []
    for _ in range(draw(st.integers(2, 3))):
        stride = draw(st.sampled_from([4, 6, 8, 12, 16]))
        size = draw(st.integers(1, stride))
        views.append((draw(st.integers(0, 40)), stride, size))
    return views


@settings(max_examples=scaled_examples(400), deadline=None)
@given(views=overlaid_views(), num_blocks=st.integers(2, 5), own_storages=st.booleans())
def test_a_layout_is_refused_exactly_when_a_byte_has_two_block_ids(
    views: list[View], num_blocks: int, own_storages: bool
) -> None:
    """Regression: views that put no byte in two block ids were refused when their
    extents overlapped with different strides ((0, 4, 1) and (0, 6, 1) share only byte 0,
    of block 0 in both), or with one stride when one started a block period or more after
    the other ((0, 64, 16) and (96, 64, 16): block b of the second sits in the gap after
    block b + 1 of the first). An accepted layout's load of one block writes exactly the
    bytes of that block."""
    owners = block_owners(views, num_blocks)
    pool = np.zeros(max(owners) + 1, dtype=np.uint8)
    tensors = make_views(views, num_blocks, own_storages, pool)
    if any(len(ids) > 1 for ids in owners.values()):
        with pytest.raises(ValueError, match="under different block ids: block"):
            discover_regions(tensors)
        return
    regions = discover_regions(tensors)
    block = num_blocks // 2
    for view in regions.block_views():  # a load into `block` writes its bytes, no others
        view[block] = 0xAB
    written = {int(i) for i in np.flatnonzero(pool)}
    assert written == {byte for byte, ids in owners.items() if ids == {block}}


@pytest.mark.parametrize(
    ("views", "clash"),
    [
        ([(0, 64, 16), (96, 64, 16)], None),  # in the gaps, one period later
        ([(0, 64, 16), (16, 32, 8)], None),  # other stride, in the gaps
        ([(0, 64, 16), (8, 128, 16)], "block 1 of kv[1] shares bytes with block 2 of kv[0]"),
        ([(0, 64, 16), (72, 64, 16)], "block 0 of kv[1] shares bytes with block 1 of kv[0]"),
        ([(0, 64, 40), (32, 64, 40)], "block 0 of kv[1] shares bytes with block 1 of kv[0]"),
    ],
)
def test_overlays_by_example(views: list[View], clash: str | None) -> None:
    """Disjoint interleaved views are accepted; a clash names a pair of blocks."""
    for own_storages in (False, True):
        tensors = make_views(views, 3, own_storages)
        if clash is None:
            assert len(discover_regions(tensors).regions) == 2
        else:
            with pytest.raises(ValueError, match=clash.replace("[", r"\[").replace("]", r"\]")):
                discover_regions(tensors)
