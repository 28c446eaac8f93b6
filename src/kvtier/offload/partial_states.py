"""State blocks kvtier never stores: keyed where a hash block ends inside them.

In a state group whose block spans several hash blocks (`KVLayout.coarse_state_groups`)
kvtier's hits end on whole blocks, so a block keyed at a hash boundary inside it is
never served. vLLM 0.33 keys such blocks in Mamba "align" mode with a prefix match unit
finer than the block (a "partial tail" at the prompt's last hash boundary), and when the
request goes on it moves that key to a block it frees at once, before the model runner
has copied the state into it: a step that fails before the copy leaves the block in the
free queue unfilled under the key, in no request's table (nothing holds it back). The
lazy walk and hand-offs skip these blocks (`StoreOutcome.PARTIAL_STATE`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.keys import Key, key_group_id
from kvtier.core.kv_groups import KVLayout
from kvtier.offload.protocols import GpuPoolView


def is_partial_state(
    layout: KVLayout, gpu_pool: GpuPoolView, gpu_block_id: int, key: Key | None = None
) -> bool:
    """Return True when the block's primary key (`key` when the caller read it) is a
    coarse state group's and ends inside the block; False for an unhashed block."""
    if key is None:
        key = gpu_pool.key(gpu_block_id)
        if key is None:
            return False
    block_size = layout.coarse_state_groups.get(key_group_id(key))
    if block_size is None:
        return False
    num_tokens = gpu_pool.num_tokens(gpu_block_id)
    return num_tokens not in (0, block_size)  # 0: not recorded, a whole block as before


def without_partial_states(
    layout: KVLayout,
    gpu_pool: GpuPoolView,
    block_ids: list[int],
    keys: Sequence[Key | None],
) -> tuple[list[int], list[Key | None]]:
    """Return `block_ids` and their `keys` without the partial state blocks."""
    kept = [
        i
        for i, key in enumerate(keys)
        if key is None or not is_partial_state(layout, gpu_pool, block_ids[i], key)
    ]
    if len(kept) == len(block_ids):
        return block_ids, list(keys)
    return [block_ids[i] for i in kept], [keys[i] for i in kept]
