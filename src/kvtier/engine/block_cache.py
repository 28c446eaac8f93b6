"""A request's GPU blocks after compute: full ones keyed by prefix hash, sliding-window
ones out of the window given back."""

from __future__ import annotations

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.engine.request import Request


def cache_full_blocks(layout: KVLayout, pool: BlockPool, request: Request, num_before: int) -> None:
    """Register the keys of blocks that became full and computed (in every group): those
    from token `num_before` to `request.num_computed_tokens`. A block keyed already is
    left as is, so a repeat (an interrupt cut one short) registers nothing twice."""
    hashes = request.block_hashes
    for group_id, group in enumerate(layout.groups):
        ratio = layout.blocks_per_hash(group_id)
        table = request.block_tables[group_id]
        start = num_before // group.block_size
        for pos in range(start, request.num_computed_tokens // group.block_size):
            block_id = table[pos]
            if block_id != NULL_BLOCK_ID and pool.key(block_id) is None:
                key = make_key(hashes[(pos + 1) * ratio - 1], group_id)
                pool.insert_key(key, block_id, group.block_size)


def drop_out_of_window(layout: KVLayout, request: Request, unfreed: list[list[int]]) -> None:
    """Take sliding-window blocks the next token can no longer attend to out of the
    request's table, onto `unfreed` (the scheduler's, which frees them).

    Each leaves the table and joins `unfreed` in one statement: an interrupt never leaves
    it in both (freed again by the abort that follows) or in neither (leaked)."""
    for group_id, group in enumerate(layout.groups):
        if group.kind is not GroupKind.SLIDING_WINDOW:
            continue
        assert group.sliding_window is not None
        first = max(0, request.num_computed_tokens - group.sliding_window + 1)
        table = request.block_tables[group_id]
        for pos in range(min(first // group.block_size, len(table))):
            if table[pos] != NULL_BLOCK_ID:
                table[pos], unfreed[len(unfreed) :] = NULL_BLOCK_ID, [[table[pos]]]
