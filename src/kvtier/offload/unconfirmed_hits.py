"""Eager mode: blocks of unconfirmed compute (`StoreSelector.unconfirmed`) a scheduled
request takes again, either to write them or to read them as a prefix hit.

vLLM keeps the blocks of a failed forward, and a priority-policy victim's blocks of its
dropped step, cached under their keys though nothing wrote them, and hands them out as
local prefix hits (docs/vllm.md, fault tolerance). A block a request writes anew leaves
the set; a hit reads a block and writes nothing, so it stays, and none of that request's
hit blocks is stored from its table.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.kv_groups import KVLayout
from kvtier.offload.protocols import RequestView, TableUpdate


def take_unconfirmed(
    unconfirmed: set[int],
    layout: KVLayout,
    request: RequestView,
    block_ids: Sequence[Sequence[int]],
    table_update: TableUpdate,
) -> int:
    """Drop the blocks `request` writes from `unconfirmed` and return the tokens of its
    prefix hit when the hit holds an unconfirmed block (0 otherwise).

    Only a new or resumed table (`TableUpdate.REPLACE`) holds hits: its blocks at the
    positions the request counts computed before the step; appended blocks are new.
    """
    if table_update is not TableUpdate.REPLACE:
        for ids in block_ids:
            unconfirmed.difference_update(ids)
        return 0
    computed = request.num_computed_tokens
    reads_unconfirmed = False
    for group, ids in zip(layout.groups, block_ids, strict=False):
        num_hit = computed // group.block_size
        reads_unconfirmed = reads_unconfirmed or not unconfirmed.isdisjoint(ids[:num_hit])
        unconfirmed.difference_update(ids[num_hit:])
    return computed if reads_unconfirmed else 0


def skip_hit(layout: KVLayout, cursors: list[int], hit_tokens: int) -> None:
    """Move a table's cursors past its prefix hit of `hit_tokens` (none of its blocks is
    selected from this table)."""
    for group_id, block_size in layout.positional_groups:
        cursors[group_id] = max(cursors[group_id], hit_tokens // block_size)
