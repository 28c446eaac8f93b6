"""Byte regions of an engine's KV tensors: where each block id's bytes live.

A region is `num_blocks` rows of `bytes_per_block` bytes, `block_stride` bytes apart,
starting `offset` bytes into one storage. A tier slot is the concatenation of every
region's bytes for one block id, in region order.

How one KV tensor becomes regions:

    shape                      layout        regions
    [2, num_blocks, ...]       KV_FIRST      2: K rows, then V rows (same block stride)
    [num_blocks, ...]          BLOCKS_FIRST  1
    ndim < 2, zero-sized       -             error

`TensorLayout.AUTO` reads a tensor as BLOCKS_FIRST unless its shape also reads as
KV_FIRST ([2, n, ...], ndim >= 3: n blocks, or 2 blocks?); it refuses those rather than
guess, since a wrong guess copies the wrong bytes as a block's KV.

A block's bytes must be one dense run (inner dims may be permuted, e.g. HND vs NHD).
Regions of one storage with the same stride are merged when their in-block byte ranges
overlap or touch: this deduplicates groups overlaying the same memory and turns the
per-layer views of one packed allocation (or the K and V halves of `[num_blocks, 2, ...]`)
into a single wider region. Regions that put one byte in blocks of two different ids
cannot be addressed by block id and are rejected (`region_overlays`), compared by address
so that views in storages of their own (built from a raw pointer) that alias one memory
count too; regions that share bytes only within blocks of one id are kept.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.transfer.region_overlays import check_no_conflicting_overlays

_ONE_BLOCK_STRIDE = 1 << 62
_DEVICE_TYPES = ("cpu", "cuda")  # devices whose bytes the worker can copy


class TensorLayout(enum.Enum):
    """Where the block dimension of a KV tensor is."""

    AUTO = "auto"  # BLOCKS_FIRST; refuses [2, ...] (ndim >= 3), which reads both ways
    BLOCKS_FIRST = "blocks_first"  # [num_blocks, ...]
    KV_FIRST = "kv_first"  # [2, num_blocks, ...]


@dataclass(frozen=True, eq=False)
class Region:
    """One addressable byte region: block `b` is `bytes_per_block` bytes at
    `offset + b * block_stride` of `base` (a flat uint8 view of the whole storage)."""

    name: str
    base: torch.Tensor
    offset: int
    block_stride: int
    bytes_per_block: int
    num_blocks: int

    def blocks(self) -> torch.Tensor:
        """Return a `[num_blocks, bytes_per_block]` uint8 view aliasing the region."""
        return self.base.as_strided(
            (self.num_blocks, self.bytes_per_block), (self.block_stride, 1), self.offset
        )

    @property
    def storage_ptr(self) -> int:
        """Return the address of the storage the region lives in."""
        return int(self.base.untyped_storage().data_ptr())

    @property
    def extent(self) -> tuple[int, int]:
        """Return the `[start, end)` byte range the region spans inside its storage."""
        end = self.offset + (self.num_blocks - 1) * self.block_stride + self.bytes_per_block
        return self.offset, end


@dataclass(frozen=True, eq=False)
class RegionSet:
    """All regions of an engine's KV cache and the slot layout they imply."""

    regions: tuple[Region, ...]
    num_blocks: int
    device: torch.device

    @property
    def bytes_per_slot(self) -> int:
        """Return the bytes of one block id over all regions (one tier slot)."""
        return sum(r.bytes_per_block for r in self.regions)

    def slot_columns(self) -> tuple[tuple[int, int], ...]:
        """Return each region's `[start, end)` byte columns inside a slot."""
        columns, start = [], 0
        for region in self.regions:
            columns.append((start, start + region.bytes_per_block))
            start += region.bytes_per_block
        return tuple(columns)

    def block_views(self) -> tuple[torch.Tensor, ...]:
        """Return one `[num_blocks, bytes_per_block]` uint8 view per region."""
        return tuple(region.blocks() for region in self.regions)


@dataclass(frozen=True)
class _Span:
    """A region candidate before merging, remembering where it was first seen."""

    order: int
    name: str
    offset: int
    block_stride: int
    bytes_per_block: int
    num_blocks: int


def discover_regions(
    kv_tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    layout: TensorLayout = TensorLayout.AUTO,
) -> RegionSet:
    """Return the deduplicated, merged regions of `kv_tensors` (a list, or name → tensor).

    Raises ValueError for a `layout` that is not a TensorLayout, and naming the tensor for
    a layout that cannot be addressed by block id:
    a sparse (non-strided) tensor, a device other than cpu or cuda (e.g. meta), fewer than
    2 dims, zero size, a block whose bytes are not one dense run, a block stride smaller
    than the block, overlays that put one byte in blocks of two ids, or tensors that
    disagree on the number of blocks or the device.
    """
    if not isinstance(layout, TensorLayout):  # "kv_first" would silently be BLOCKS_FIRST
        raise ValueError(f"layout must be a TensorLayout, got {layout!r}")
    named = _named(kv_tensors)
    if not named:
        raise ValueError("no KV tensors to register")
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ValueError(f"KV tensors live on several devices: {sorted(map(str, devices))}")
    bases: dict[int, torch.Tensor] = {}
    spans: dict[int, list[_Span]] = {}
    for order, (name, tensor) in enumerate(named):
        storage = tensor.untyped_storage()
        ptr = int(storage.data_ptr())
        # Storages of their own (frombuffer, DLPack) may start at one address with
        # different sizes: the largest holds every view of them.
        if ptr not in bases or storage.nbytes() > bases[ptr].numel():
            bases[ptr] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        spans.setdefault(ptr, []).extend(_tensor_spans(order, name, tensor, layout))
    merged: list[tuple[int, Region]] = []
    for ptr, storage_spans in spans.items():
        merged.extend(_merge(storage_spans, bases[ptr]))
    merged.sort(key=lambda item: (item[0], item[1].offset))
    regions = tuple(region for _, region in merged)
    counts = {r.name: r.num_blocks for r in regions}
    if len(set(counts.values())) != 1:  # before the overlays: the plainer error
        raise ValueError(f"KV tensors disagree on the number of blocks: {counts}")
    # By address, over every storage: views built from a raw pointer (frombuffer, DLPack)
    # get storages of their own that may alias another's bytes.
    check_no_conflicting_overlays(regions)
    return RegionSet(regions=regions, num_blocks=regions[0].num_blocks, device=devices.pop())


def _named(
    kv_tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    if isinstance(kv_tensors, torch.Tensor):  # iterating it would slice its first dim
        raise TypeError(
            f"kv_tensors is one tensor of shape {tuple(kv_tensors.shape)}: pass a list or a "
            "dict of KV tensors (one packed allocation is [that_tensor])"
        )
    items = (
        list(kv_tensors.items())
        if isinstance(kv_tensors, Mapping)
        else [(f"kv[{i}]", t) for i, t in enumerate(kv_tensors)]
    )
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"KV tensor {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.layout is not torch.strided:
            raise ValueError(
                f"KV tensor {name!r} has layout {tensor.layout}: need a dense (strided) tensor"
            )
        if tensor.device.type not in _DEVICE_TYPES:
            raise ValueError(
                f"KV tensor {name!r} is on {tensor.device}: need a cpu or cuda device "
                "(the worker copies its bytes)"
            )
    return items


def _resolve(layout: TensorLayout, tensor: torch.Tensor, name: str) -> TensorLayout:
    if layout is not TensorLayout.AUTO:
        return layout
    if tensor.dim() >= 3 and tensor.shape[0] == 2:
        # [2 (K, V), n blocks, ...] or [2 blocks, ...]: both address bytes, different ones.
        raise ValueError(
            f"KV tensor {name!r} has shape {tuple(tensor.shape)}: TensorLayout.AUTO "
            "cannot tell K/V from blocks; pass layout=TensorLayout.KV_FIRST "
            f"({tensor.shape[1]} blocks) or TensorLayout.BLOCKS_FIRST (2 blocks)"
        )
    return TensorLayout.BLOCKS_FIRST


def _tensor_spans(order: int, name: str, tensor: torch.Tensor, layout: TensorLayout) -> list[_Span]:
    """Return the 1 (BLOCKS_FIRST) or 2 (KV_FIRST) spans of one tensor."""
    if layout is TensorLayout.KV_FIRST and tensor.dim() < 3:
        raise ValueError(
            f"KV tensor {name!r} has shape {tuple(tensor.shape)}: TensorLayout.KV_FIRST needs "
            f"at least 3 dims, [2 (K, V), num_blocks, ...], got {tensor.dim()}"
        )
    if tensor.dim() < 2 or tensor.numel() == 0:
        raise ValueError(
            f"KV tensor {name!r} has shape {tuple(tensor.shape)}: need at least "
            "[num_blocks, ...] with no zero-sized dimension"
        )
    kind = _resolve(layout, tensor, name)
    block_dim = 1 if kind is TensorLayout.KV_FIRST else 0
    if kind is TensorLayout.KV_FIRST and tensor.shape[0] != 2:
        raise ValueError(
            f"KV tensor {name!r} has shape {tuple(tensor.shape)}: {kind} needs "
            f"[2 (K, V), num_blocks, ...], got {tensor.shape[0]} in the first dim"
        )
    elem = tensor.element_size()
    shape, strides = [int(n) for n in tensor.shape], [int(n) for n in tensor.stride()]
    inner = list(zip(shape[block_dim + 1 :], strides[block_dim + 1 :], strict=True))
    bytes_per_block = math.prod(size for size, _ in inner) * elem
    _check_dense(name, tensor, inner)
    num_blocks = shape[block_dim]
    # With one block the stride is meaningless; make every view of it agree.
    block_stride = strides[block_dim] * elem if num_blocks > 1 else _ONE_BLOCK_STRIDE
    if num_blocks > 1 and block_stride < bytes_per_block:
        raise ValueError(
            f"KV tensor {name!r}: block stride {block_stride} B is smaller than a block "
            f"({bytes_per_block} B); blocks overlap (shape {tuple(tensor.shape)}, "
            f"strides {tensor.stride()})"
        )
    base = int(tensor.storage_offset()) * elem
    parts = [("", 0)]
    if kind is TensorLayout.KV_FIRST:
        parts = [("[K]", 0), ("[V]", strides[0] * elem)]
    return [
        _Span(order, name + tag, base + shift, block_stride, bytes_per_block, num_blocks)
        for tag, shift in parts
    ]


def _check_dense(name: str, tensor: torch.Tensor, inner: list[tuple[int, int]]) -> None:
    """Raise unless the dims inside a block cover one dense run of elements."""
    expected = 1
    for size, stride in sorted((d for d in inner if d[0] > 1), key=lambda d: d[1]):
        if stride != expected:
            raise ValueError(
                f"KV tensor {name!r}: a block's bytes are not contiguous (shape "
                f"{tuple(tensor.shape)}, strides {tensor.stride()}); cannot copy whole blocks"
            )
        expected *= size


def slot_bytes(rows: Iterable[tuple[int, int, int]], num_blocks: int) -> int:
    """Return the bytes of one tier slot over block rows of one storage, each given as
    `(offset, block_stride, bytes_per_block)` for `num_blocks` blocks, merged as
    `discover_regions` merges them (lets a caller size tiers before the worker registers).
    With one block the strides are ignored, as there."""
    spans = [
        _Span(0, "", offset, stride if num_blocks > 1 else _ONE_BLOCK_STRIDE, size, num_blocks)
        for offset, stride, size in rows
    ]
    return sum(end - start for _, start, end in _runs(spans))


def _runs(spans: list[_Span]) -> Iterator[tuple[list[_Span], int, int]]:
    """Yield the spans of each merged region, and its `[start, end)` bytes in the storage."""
    groups: dict[tuple[int, int], list[_Span]] = {}
    for span in spans:
        groups.setdefault((span.block_stride, span.num_blocks), []).append(span)
    for (stride, _), group in groups.items():
        group.sort(key=lambda s: s.offset)
        current = [group[0]]
        start, end = group[0].offset, group[0].offset + group[0].bytes_per_block
        for span in group[1:]:
            span_end = span.offset + span.bytes_per_block
            if span.offset <= end and max(end, span_end) - start <= stride:
                current.append(span)
                end = max(end, span_end)
                continue
            yield current, start, end
            current, start, end = [span], span.offset, span_end
        yield current, start, end


def _merge(spans: list[_Span], base: torch.Tensor) -> list[tuple[int, Region]]:
    """Merge spans of one storage whose in-block byte ranges overlap or touch."""
    return [
        _region(run, base, end - start, run[0].block_stride) for run, start, end in _runs(spans)
    ]


def _region(spans: list[_Span], base: torch.Tensor, size: int, stride: int) -> tuple[int, Region]:
    """Return (first-seen order, region) of merged spans."""
    names = list(dict.fromkeys(s.name for s in spans))
    label = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)} views)"
    first = spans[0]
    region = Region(label, base, first.offset, stride, size, first.num_blocks)
    if region.extent[1] > base.numel():
        raise ValueError(f"region {label} runs past the end of its storage")
    return min(s.order for s in spans), region
