"""How much of a request whose load failed holds valid KV (docs/load_failures.md)."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.offload.transfers import FailedLoad


def valid_prefix(
    layout: KVLayout,
    block_tables: Sequence[Sequence[int]],
    failed: FailedLoad,
    suspects: Sequence[int] | None,
) -> int:
    """Return the tokens of a failed load's request that hold valid KV: up to its first
    block whose copy is suspect (`ReportOutcome.suspect_gpu_blocks`; before it, its local
    prefix and the blocks loaded whole), else 0 (recompute from scratch).

    Only with one full-attention group: a sliding window or a state at a shorter prefix
    needs blocks the load never wrote. A load dropped before it was issued (no suspects),
    or a suspect block outside the request's table, keeps nothing.
    """
    if not suspects or len(layout.groups) != 1:
        return 0
    group = layout.groups[0]
    if group.kind is not GroupKind.FULL_ATTENTION:
        return 0
    table = block_tables[0]
    position = {block_id: pos for pos, block_id in enumerate(table)}
    if any(block_id not in position for block_id in suspects):
        return 0
    keep = min(position[block_id] for block_id in suspects) * group.block_size
    return keep if failed.start_token <= keep < failed.end_token else 0
