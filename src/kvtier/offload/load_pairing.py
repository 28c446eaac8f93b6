"""Which tier block a load copies into which GPU block (SPEC §6.3).

A lookup's hit lists, per KV group, the tier blocks from the first block after the local
prefix; the engine's block table of the request holds the GPU blocks they fill.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import LongestHit


def pair_blocks(
    layout: KVLayout,
    num_local_tokens: int,
    hit: LongestHit,
    block_ids_per_group: Sequence[Sequence[int]],
    num_tokens: int,
) -> tuple[list[int], list[int]]:
    """Return (tier block ids, GPU block ids), paired by position, that load `num_tokens`
    tokens of `hit` after the `num_local_tokens` local ones (null positions skipped).

    Raises ValueError when a group's block table is too short for them, or names the
    null block where a tier block is to land.
    """
    tier_ids: list[int] = []
    gpu_ids: list[int] = []
    for group_id in layout.cacheable_group_ids:
        block_size = layout.groups[group_id].block_size
        first = num_local_tokens // block_size
        table = block_ids_per_group[group_id]
        num_blocks = -(-num_tokens // block_size)
        if len(table) < first + num_blocks:
            raise ValueError(
                f"group {group_id}: a block table of {len(table)} blocks cannot hold "
                f"{num_local_tokens} local + {num_tokens} external tokens"
            )
        sources = hit.block_ids[group_id][:num_blocks]
        destinations = table[first : first + len(sources)]
        if NULL_BLOCK_ID not in sources and NULL_BLOCK_ID not in destinations:
            # The common hit (full attention): every position paired, by C slices.
            tier_ids.extend(sources)
            gpu_ids.extend(destinations)
            continue
        for i, tier_block in enumerate(sources):
            if tier_block == NULL_BLOCK_ID:
                continue
            gpu_block = table[first + i]
            if gpu_block == NULL_BLOCK_ID:
                raise ValueError(f"group {group_id}: load destination {first + i} is null")
            tier_ids.append(tier_block)
            gpu_ids.append(gpu_block)
    return tier_ids, gpu_ids
