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

from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.core.pool_block import NULL_BLOCK_ID
from kvtier.offload.block_payload import request_key
from kvtier.offload.config import StoreMode
from kvtier.offload.protocols import GpuPoolView, RequestView
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
    The request's own block may be keyed under a partial hash of its position (vLLM's
    partial tail, with blocks spanning several hash blocks): that key is its own too.
    """
    layout, gpu_pool = selector.layout, selector.gpu_pool
    if finished_earlier:
        block_ids_per_group = [
            [
                b
                if b == NULL_BLOCK_ID
                or not gpu_pool.block(b).ref_count
                or _keyed_by(layout, request, group_id, pos, gpu_pool.key(b))
                else NULL_BLOCK_ID
                for pos, b in enumerate(table)
            ]
            for group_id, table in enumerate(block_ids_per_group)
        ]
    block_ids = unconfirmed_blocks(layout, request, block_ids_per_group, gpu_pool)
    # Selected since the last plan (an earlier finish's stores): no plan the workers
    # fail carries them, and their blocks are about to lose the keys they registered.
    selector.drop_queued(block_ids)
    if store_mode is StoreMode.LAZY:
        selector.lazy.hold_back(block_ids, gpu_pool.keys(block_ids))
    else:
        selector.unconfirmed.update(block_ids)
    drop = keys_to_drop(block_ids_per_group, block_ids, gpu_pool)
    drop += boundary_states(layout, request, block_ids_per_group, gpu_pool)
    gpu_pool.discard_keys_of(list(dict.fromkeys(drop)))


def _keyed_by(
    layout: KVLayout, request: RequestView, group_id: int, pos: int, key: Key | None
) -> bool:
    """Return True when `key` is one of the request's keys of block `pos` in a group: the
    whole block's, or a partial one of a hash block inside it."""
    if key is None:
        return False
    ratio = layout.blocks_per_hash(group_id)
    hashes = request.block_hashes
    end = min((pos + 1) * ratio, len(hashes))
    return any(make_key(hashes[i], group_id) == key for i in range(pos * ratio, end))


def unconfirmed_blocks(
    layout: KVLayout,
    request: RequestView,
    block_ids_per_group: Sequence[Sequence[int]],
    gpu_pool: GpuPoolView,
) -> list[int]:
    """Return the GPU blocks an unconfirmed finish must hold back (`LazyWalk.hold_back`):
    its table's blocks, every block cached under the key of a null position, and its
    `boundary_states`.

    A sliding window (or a state group) drops blocks from the table while the request
    runs, and the engine frees them with their keys; one its failed forward wrote and
    then dropped (vLLM drops at schedule time, before an overlapped forward's failure is
    known) leaves no other trace. Each such key may name several blocks (another
    request's copy among them): all are held back, a lost store at worst.
    """
    found = [b for ids in block_ids_per_group for b in ids if b != NULL_BLOCK_ID]
    for group_id, table in enumerate(block_ids_per_group):
        for pos, block_id in enumerate(table):
            if block_id == NULL_BLOCK_ID:
                key = request_key(layout, request, group_id, pos)
                if key is None:
                    break  # not hashed, nor any later position
                found.extend(gpu_pool.cached_blocks(key))
    found.extend(boundary_states(layout, request, block_ids_per_group, gpu_pool))
    return list(dict.fromkeys(found))


def boundary_states(
    layout: KVLayout,
    request: RequestView,
    block_ids_per_group: Sequence[Sequence[int]],
    gpu_pool: GpuPoolView,
) -> list[int]:
    """Return the blocks cached under the request's keys in its state groups.

    vLLM's Mamba "align" mode keeps the state at a hash-block boundary in a block it
    copied out of the table, keyed by the request's (partial) key there; the table's
    block holds the running state. Their keys are dropped whoever holds them: one left
    cached gave a later request a hit on the state's prefix alone, and vLLM copied the
    attention block of that prefix from a request keyed, not yet written, in the same
    step (its partial-hit copy-on-write).
    """
    hashes = request.block_hashes
    found = []
    for group_id, table in enumerate(block_ids_per_group):
        if layout.groups[group_id].kind is GroupKind.STATE:
            ratio = layout.blocks_per_hash(group_id)
            for index in range(min(len(table) * ratio, len(hashes))):
                found.extend(gpu_pool.cached_blocks(make_key(hashes[index], group_id)))
    return found


def keys_to_drop(
    block_ids_per_group: Sequence[Sequence[int]], held: Sequence[int], gpu_pool: GpuPoolView
) -> list[int]:
    """Return the blocks of an unconfirmed finish (`held`, `unconfirmed_blocks`) whose
    keys the engine's pool must drop (`GpuPoolView.discard_keys_of`): its table's, and
    the free ones cached under the keys of its null positions. One another request
    uses under such a key stays cached: that request holds it in its own table (an
    engine aborting every request after a fault drops it with that request's)."""
    own = {b for ids in block_ids_per_group for b in ids}
    return [b for b in held if b in own or not gpu_pool.block(b).ref_count]
