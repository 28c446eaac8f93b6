"""`slot_bytes` (sizing tiers before the worker registers) against `discover_regions` (what
the worker's regions hold): the same bytes per slot for every layout the worker accepts;
the vLLM worker refuses to register when the two differ."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.transfer.regions import discover_regions, slot_bytes

Row = tuple[int, int, int]  # (byte offset, block stride, bytes per block)


@st.composite
def rows_of_one_storage(draw: st.DrawFn) -> list[Row]:
    """1-3 block rows with strides from a small set (equal ones common), pages within
    their stride as vLLM places them."""
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        stride = draw(st.sampled_from([4, 8, 12, 16]))
        rows.append((draw(st.integers(0, 30)), stride, draw(st.integers(1, stride))))
    return rows


@settings(max_examples=scaled_examples(300), deadline=None)
@given(rows=rows_of_one_storage(), num_blocks=st.integers(1, 4))
def test_slot_bytes_are_what_the_registered_regions_hold(rows: list[Row], num_blocks: int) -> None:
    """Regression: with one block `discover_regions` merges views whatever their stride
    (it is meaningless there) but `slot_bytes` kept them apart by stride: block rows
    (0, 8, 8) and (0, 16, 8) of one block, one page aliased by two groups, were sized
    16 B and registered as 8 B, so the vLLM worker refused them as a kvtier bug."""
    end = max(offset + (num_blocks - 1) * stride + size for offset, stride, size in rows)
    base = torch.zeros(end, dtype=torch.uint8)
    views = [
        base.as_strided((num_blocks, size), (stride, 1), offset) for offset, stride, size in rows
    ]
    try:
        registered = discover_regions(views).bytes_per_slot
    except ValueError:  # not addressable by block id: refused before any sizing matters
        return
    assert slot_bytes(rows, num_blocks) == registered
