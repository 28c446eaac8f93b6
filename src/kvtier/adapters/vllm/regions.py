"""Byte views of vLLM's KV allocation, built from the `KVCacheConfig` placement.

vLLM allocates one backing buffer per rank and describes where every layer's page of
every block lives (`KVCacheTensor`): layer `layers[l]`'s page of block `b` starts at
`offset + l * layer_stride + b * block_stride`. The per-layer tensors the worker receives
are views of that buffer whose shapes depend on the attention backend (kernel blocks
may split a block, K and V may be separate), so kvtier addresses blocks from the
placement instead: one `[num_blocks, page_bytes]` uint8 view per placed layer, handed to
kvtier's region discovery (which deduplicates aliased groups and merges adjacent
pages into one region).

A page must be one dense run of bytes, which holds for layouts whose two outermost
dimensions are the layer and the block (`LBNHC`, `LBHNC`, `BLNHC`, `BLHNC`). Others
(heads outside blocks) are refused with a message naming the layout.

No vLLM import: the config objects are read by attribute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.transfer.regions import slot_bytes

KVCacheValue = torch.Tensor | Sequence[torch.Tensor]


class PlacementError(ValueError):
    """vLLM's KV placement cannot be addressed as whole blocks."""


def is_block_compact(layout_name: str) -> bool:
    """Return True when a layout name keeps each page as one dense run (L and B outermost)."""
    return len(layout_name) >= 2 and set(layout_name[:2]) == {"L", "B"}


def placement_block_views(
    kv_cache_config: Any,
    kv_caches: Mapping[str, KVCacheValue],
    layout_name: str | None,
) -> dict[str, torch.Tensor]:
    """Return one `[num_blocks, page_bytes]` uint8 view per placed layer, by layer name.

    `kv_caches` is what `register_kv_caches` received; it supplies the backing storage
    and is checked against the placement. Host-resident placements are skipped.
    Raises `PlacementError` naming the layer or layout that cannot be addressed.
    """
    if layout_name is None:
        raise PlacementError("the KV cache layout is not resolved (kv_cache_layout is None)")
    if not is_block_compact(layout_name):
        raise PlacementError(
            f"KV cache layout {layout_name} splits a block's page into several runs; "
            "kvtier copies whole pages: set VLLM_KV_CACHE_LAYOUT to one of LBNHC, LBHNC, "
            "BLNHC, BLHNC that the attention backend supports (ROCm's backends that "
            "prefer LHBNC also take LBHNC)"
        )
    pages = _placed_pages(kv_cache_config)
    base, size = _backing_bytes(kv_caches)
    num_blocks = int(kv_cache_config.num_blocks)
    views: dict[str, torch.Tensor] = {}
    for name, start, stride, page in pages:
        end = start + (num_blocks - 1) * stride + page
        if num_blocks > 1 and page > stride:
            raise PlacementError(
                f"layer {name!r}: page of {page} B exceeds the block stride {stride} B"
            )
        if start < 0 or end > size:
            raise PlacementError(
                f"layer {name!r}: bytes [{start}, {end}) lie outside the {size}-byte KV allocation"
            )
        _check_view_start(name, kv_caches.get(name), start, base)
        views[name] = base.as_strided((num_blocks, page), (stride, 1), start)
    return views


def placement_slot_bytes(kv_cache_config: Any) -> int:
    """Return the bytes of one tier slot for this placement, as the worker's regions of
    `placement_block_views` will hold it: every page of one block id, bytes that groups
    alias once, and none of the padding vLLM may add to align a block."""
    rows = [(start, stride, page) for _, start, stride, page in _placed_pages(kv_cache_config)]
    return slot_bytes(rows, int(kv_cache_config.num_blocks))


def _placed_pages(kv_cache_config: Any) -> list[tuple[str, int, int, int]]:
    """Return (layer name, byte of its block 0, block stride, page bytes) of every layer
    placed on the device."""
    placements = [t for t in kv_cache_config.kv_cache_tensors if not t.host_resident]
    if not placements:
        raise PlacementError("the KV cache config places no tensor on the device")
    page_bytes = layer_page_bytes(kv_cache_config)
    pages = []
    for placement in placements:
        for index, name in enumerate(placement.layers):
            page = page_bytes.get(name)
            if page is None:
                raise PlacementError(f"layer {name!r} is placed but belongs to no KV group")
            start = int(placement.offset) + index * int(placement.layer_stride)
            pages.append((name, start, int(placement.block_stride), page))
    return pages


def _backing_bytes(kv_caches: Mapping[str, KVCacheValue]) -> tuple[torch.Tensor, int]:
    """Return a flat uint8 tensor over the one storage all KV tensors share, and its size."""
    tensors = [t for value in kv_caches.values() for t in _tensors(value)]
    if not tensors:
        raise PlacementError("register_kv_caches received no KV tensors")
    storage = tensors[0].untyped_storage()
    ptr = storage.data_ptr()
    others = sorted(
        {
            n
            for n, v in kv_caches.items()
            for t in _tensors(v)
            if t.untyped_storage().data_ptr() != ptr
        }
    )
    if others:
        raise PlacementError(
            f"KV tensors of layers {others[:4]} live outside the shared KV allocation"
        )
    base = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage)
    return base, storage.nbytes()


def _tensors(value: KVCacheValue) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def layer_page_bytes(kv_cache_config: Any) -> dict[str, int]:
    """Return the page bytes of every layer of a KV cache group, by layer name.

    A worker's `UniformTypeKVCacheSpecs` group names each layer's spec, but vLLM's
    scheduler role gets a copy holding one of them for the whole group
    (`generate_scheduler_kv_cache_config`). A layer placed as that spec's pages could not
    be holds another spec's: its page is read from its placement (`_placed_page`).
    """
    placed = {
        name: t
        for t in kv_cache_config.kv_cache_tensors
        if not t.host_resident
        for name in t.layers
    }
    num_blocks = int(kv_cache_config.num_blocks)
    pages: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for name in group.layer_names:
            if per_layer is not None:
                pages[name] = int(per_layer[name].page_size_bytes)
            else:
                pages[name] = _placed_page(spec, placed.get(name), num_blocks)
    return pages


def _placed_page(spec: Any, placement: Any, num_blocks: int) -> int:
    """Return the page of a layer of `spec`'s group placed by `placement`.

    vLLM's planner gives each distinct layer spec its own placement: block-outermost,
    its layer stride is the page; layer-outermost (layer stride = block stride x
    blocks), its block stride is the page rounded up to the spec's
    `block_stride_alignment`. A placement `spec` could have made holds `spec`'s pages;
    another holds another spec's, whose page is the stride (exact unless that spec's
    alignment rounded it up: `layout.check_scheduler_agrees` refuses that on the worker).
    """
    page = int(spec.page_size_bytes)
    if placement is None:
        return page
    layer_stride, block_stride = int(placement.layer_stride), int(placement.block_stride)
    if block_stride > 0 and layer_stride == block_stride * num_blocks:  # layer-outermost
        return page if block_stride in (page, _padded_page(spec)) else block_stride
    if layer_stride > 0 and layer_stride * len(placement.layers) <= block_stride:
        return layer_stride  # block-outermost: the layers' pages side by side in a block
    return page  # a placement vLLM's planner does not make: the spec's page, as it says


def _padded_page(spec: Any) -> int:
    """Return `spec`'s page rounded up to its block stride alignment, as vLLM's planner
    strides a layer-outermost block."""
    alignment = getattr(spec, "get_block_stride_alignment", lambda: 1)()
    return -(-int(spec.page_size_bytes) // alignment) * alignment


def _check_view_start(
    name: str, value: KVCacheValue | None, start: int, base: torch.Tensor
) -> None:
    """Raise when a layer's own view does not start where the placement says."""
    if not isinstance(value, torch.Tensor):
        return  # absent, or a list of state tensors: nothing to compare against
    offset = value.storage_offset() * value.element_size()
    is_whole_buffer = offset == 0 and value.numel() * value.element_size() == base.numel()
    if not is_whole_buffer and offset != start:
        raise PlacementError(
            f"layer {name!r}: its KV tensor starts at byte {offset} but the placement says {start}"
        )
