"""Block arithmetic of the reference scheduler: how many GPU blocks a request's tokens
take in every KV group of a layout (sliding-window groups keep only their window)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.engine.request import Request


def first_needed_block(layout: KVLayout, group_id: int, num_tokens: int) -> int:
    """Return the first block of group `group_id` the token after `num_tokens` attends to
    (0 outside sliding-window groups)."""
    group = layout.groups[group_id]
    if group.kind is not GroupKind.SLIDING_WINDOW:
        return 0
    return max(0, num_tokens // group.block_size - group.num_window_blocks)


def num_hit_blocks(layout: KVLayout, num_local: int, num_hit: int) -> int:
    """Return the blocks, over all groups, a hit of `num_hit` tokens adds to a local hit
    of `num_local` (only those the next token still needs)."""
    total = 0
    for group_id, group in enumerate(layout.groups):
        first = max(num_local // group.block_size, first_needed_block(layout, group_id, num_hit))
        total += max(0, num_hit // group.block_size - first)
    return total


def num_blocks_after(layout: KVLayout, num_tokens: int, num_new: int) -> int:
    """Return the blocks, over all groups, `num_new` tokens after `num_tokens` open."""
    total = 0
    for group in layout.groups:
        have = -(-num_tokens // group.block_size)
        total += -(-(num_tokens + num_new) // group.block_size) - have
    return total


def num_new_blocks(layout: KVLayout, request: Request, num_new: int) -> int:
    """Return the blocks `request` must append to its tables to compute `num_new` more
    tokens."""
    total = 0
    for group, table in zip(layout.groups, request.block_tables, strict=True):
        need = -(-(request.num_computed_tokens + num_new) // group.block_size)
        total += max(0, need - len(table))
    return total


def most_that_fit(num_new: int, fits: Callable[[int], bool]) -> int | None:
    """Return the largest n in [1, num_new] with `fits(n)` (monotone: true up to some n),
    or None when even one token does not fit (a binary search: every length is tried,
    also one that needs no new block, inside a block already held)."""
    if num_new < 1 or not fits(1):
        return None
    low, high = 1, num_new  # fits(low) holds
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
