"""Whether byte regions that overlay one memory can still be addressed by block id.

Regions may share bytes as long as each shared byte lies in blocks of one id in both
(groups overlaying one cache, the V halves of a cache imported again in a storage of their
own): a load of block i then writes those bytes twice, with the same values. A byte in
block i of one region and block j != i of another cannot be: a load of one block would
overwrite part of another. Compared by address, so regions of different storages that
alias one memory count too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtier.transfer.regions import Region


def check_no_conflicting_overlays(regions: Sequence[Region]) -> None:
    """Raise ValueError naming two regions and a pair of their blocks with different ids
    that share a byte."""
    ordered = sorted(regions, key=_address_range)
    for i, first in enumerate(ordered):
        first_start, first_end = _address_range(first)
        for second in ordered[i + 1 :]:
            second_start, _ = _address_range(second)
            if second_start >= first_end:  # sorted by start: no later one overlaps either
                break
            shift = second_start - first_start
            if first.block_stride == second.block_stride:
                clash = _same_stride_clash(first, second, shift)
            else:
                clash = _clash(first, second, shift)
            if clash is not None:
                raise ValueError(
                    f"regions {first.name} and {second.name} overlay the same memory under "
                    f"different block ids: block {clash[1]} of {second.name} shares "
                    f"bytes with block {clash[0]} of {first.name} ({shift} B apart, "
                    f"block strides {first.block_stride}/{second.block_stride} B, blocks "
                    f"{first.bytes_per_block}/{second.bytes_per_block} B)"
                )


def _address_range(region: Region) -> tuple[int, int]:
    """Return the `[start, end)` addresses the region spans (its extent in memory)."""
    start, end = region.extent
    return region.storage_ptr + start, region.storage_ptr + end


def _same_stride_clash(first: Region, second: Region, shift: int) -> tuple[int, int] | None:
    """Return `(block of first, block of second)` with different ids sharing a byte, or
    None; both regions have one block stride and `second` starts `shift` >= 0 bytes after
    `first`."""
    periods, within = divmod(shift, first.block_stride)
    # Block j of `second` spans bytes [within, within + size) of block period j + periods
    # of `first`, running at most into the next period (size <= stride): it meets block
    # j + periods of `first` when within < first's block size, and block j + periods + 1
    # when it runs past the period. j = 0 is the first block for which either exists.
    if periods and within < first.bytes_per_block and periods < first.num_blocks:
        return periods, 0
    if within + second.bytes_per_block > first.block_stride and periods + 1 < first.num_blocks:
        return periods + 1, 0
    return None


def _clash(first: Region, second: Region, shift: int) -> tuple[int, int] | None:
    """Return `(block of first, block of second)` with different ids sharing a byte, or
    None; `second` starts `shift` >= 0 bytes after `first` (any strides)."""
    ids = torch.arange(first.num_blocks, dtype=torch.int64)
    starts = ids * first.block_stride - shift  # each block of `first`, from second's start
    stride = second.block_stride
    # The blocks of `second` meeting block i of `first` are the run lo[i]..hi[i]: those
    # that end after it starts and start before it ends.
    lo = torch.div(starts - second.bytes_per_block, stride, rounding_mode="floor") + 1
    hi = torch.div(starts + first.bytes_per_block - 1, stride, rounding_mode="floor")
    lo, hi = lo.clamp(min=0), hi.clamp(max=second.num_blocks - 1)
    clashing = (lo <= hi) & ((lo != ids) | (hi != ids))
    if not bool(clashing.any()):
        return None
    block = int(clashing.nonzero()[0, 0])
    other = int(lo[block]) if int(lo[block]) != block else int(hi[block])
    return block, other
