"""A finish the engine cannot vouch for: its blocks kept out of every tier and out of
the engine's own prefix cache.

A forward pass failed (vLLM's fault tolerance), so the compute the engine counts in the
request's `num_computed_tokens` may never have run: its blocks hold whatever they held
before, under keys the engine gave them as it scheduled them. They are held back (lazy
mode's walk skips them; eager mode stores no window position from one) and lose their
keys in the engine's pool, which then serves none of them as a prefix hit.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.pool_block import NULL_BLOCK_ID
from kvtier.offload.block_payload import request_key
from kvtier.offload.config import StoreMode
from kvtier.offload.lazy_walk import keys_to_drop, unconfirmed_blocks
from kvtier.offload.protocols import RequestView
from kvtier.offload.store_selection import StoreSelector


def hold_back_unconfirmed(
    selector: StoreSelector,
    store_mode: StoreMode,
    request: RequestView,
    block_ids_per_group: Sequence[Sequence[int]],
    finished_earlier: bool = False,
) -> None:
    """Hold back the request's blocks (`unconfirmed_blocks`) and drop their keys in the
    engine's pool (`keys_to_drop`).

    `finished_earlier`: the request finished before the engine learned of the failure
    (vLLM: a user's abort while its step was in flight), so the engine may have given
    its blocks to other requests since: a block another request holds under another
    key is looked up by the request's key at its position instead, as a null one is.
    """
    layout, gpu_pool = selector.layout, selector.gpu_pool
    if finished_earlier:
        block_ids_per_group = [
            [
                b
                if b == NULL_BLOCK_ID
                or not gpu_pool.block(b).ref_count
                or gpu_pool.key(b) == request_key(layout, request, group_id, pos)
                else NULL_BLOCK_ID
                for pos, b in enumerate(table)
            ]
            for group_id, table in enumerate(block_ids_per_group)
        ]
    block_ids = unconfirmed_blocks(layout, request, block_ids_per_group, gpu_pool)
    if store_mode is StoreMode.LAZY:
        selector.lazy.hold_back(block_ids, gpu_pool.keys(block_ids))
    else:
        selector.unconfirmed.update(block_ids)
    gpu_pool.discard_keys_of(keys_to_drop(block_ids_per_group, block_ids, gpu_pool))
