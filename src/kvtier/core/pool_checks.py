"""What a `BlockPool` checks: arguments (`insert_key`'s key and count, `allocate`'s count)
and, in `check_invariants`, what must hold between any two operations; and `PoolError`,
what the pool raises (`kvtier.core.block_pool` re-exports it).

Kept apart from `block_pool` so the pool's file holds its operations only; the invariant
checks read the pool's internal arrays and dicts directly, as its own method would.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from kvtier.core.keys import Key
from kvtier.core.pool_block import NULL_BLOCK_ID

if TYPE_CHECKING:
    from kvtier.core.block_pool import BlockPool


MAX_NUM_TOKENS = 2**31 - 1  # the token counts live in an array('i')


class PoolError(RuntimeError):
    """A pool operation was asked for something the pool cannot do."""


def check_key(key: Key, num_tokens: int) -> int:
    """Return `num_tokens` as an int (a numpy integer too, as `insert_keys` takes it);
    raise naming the bad value when `key` is not a key or `num_tokens` not a count."""
    if not isinstance(key, bytes):
        raise TypeError(f"key {key!r} has type {type(key).__name__}; expected bytes")
    numpy_int = not isinstance(num_tokens, int) and hasattr(num_tokens, "__index__")
    if numpy_int:
        num_tokens = num_tokens.__index__()
    if (
        isinstance(num_tokens, bool)
        or not isinstance(num_tokens, int)
        or not 0 <= num_tokens <= MAX_NUM_TOKENS
    ):
        raise ValueError(f"num_tokens must be an int in [0, {MAX_NUM_TOKENS}], got {num_tokens!r}")
    return num_tokens


def as_block_count(value: object) -> int:
    """Return `value` as an int (a numpy integer too); raise TypeError naming it otherwise."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"cannot allocate {value!r} blocks: not an int")
    return int(value.__index__())


def allocation_size(value: object) -> int:
    """Return `value` as a block count for `allocate`; raise TypeError for a non-int and
    PoolError for a negative one, naming it."""
    num_blocks = as_block_count(value)
    if num_blocks < 0:
        raise PoolError(f"cannot allocate a negative number of blocks ({num_blocks})")
    return num_blocks


def check_pool_invariants(pool: BlockPool) -> None:
    """Raise AssertionError when `pool`'s bookkeeping is inconsistent."""
    _check_free_queue(pool)
    _check_keys(pool)
    pool._free.check_invariants()  # links and length; a policy's lists, ghosts and sketches


def _check_free_queue(pool: BlockPool) -> None:
    refs = pool._refs
    # Bounded: links that cycle past the sentinel must fail, not loop forever.
    free_blocks = list(islice(pool._free.iter_after(None), len(pool._free) + 1))
    assert len(free_blocks) == len(pool._free), "free queue length disagrees with its links"
    assert len(set(free_blocks)) == len(free_blocks), "a block is queued twice"
    assert NULL_BLOCK_ID not in free_blocks, "the null block is in the free queue"
    assert refs[NULL_BLOCK_ID] == 0, "the null block is referenced"
    assert min(refs) >= 0, "negative ref count"
    num_zero = sum(1 for b in range(1, pool.num_blocks) if refs[b] == 0)
    assert num_zero == len(free_blocks), "free queue differs from the ref-0 blocks"
    assert all(refs[b] == 0 for b in free_blocks), "a referenced block is free"
    keys = pool._keys
    first_cached = next(
        (i for i, b in enumerate(free_blocks) if keys[b] is not None), len(free_blocks)
    )
    assert all(keys[b] is not None for b in free_blocks[first_cached:]), (
        "an unhashed free block is queued behind a cached one (SPEC §4: reused first)"
    )


def _check_keys(pool: BlockPool) -> None:
    keys, secondary, index, more = pool._keys, pool._secondary, pool._index, pool._more_blocks
    assert keys[NULL_BLOCK_ID] is None, "the null block holds a key"
    for key, first in index.items():
        others = more.get(key, [])
        holders = [first, *others]
        assert len(set(holders)) == len(holders), f"index lists block {first} twice for a key"
        for block_id in holders:
            held = [keys[block_id], *secondary.get(block_id, ())]
            assert key in held, f"index maps a key to block {block_id}, which lacks it"
    assert all(more.values()), "an empty list of further blocks is kept for a key"
    assert all(secondary.values()), "an empty list of secondary keys is kept for a block"
    assert more.keys() <= index.keys(), "further blocks of a key missing from the index"
    for block_id in pool._tags:
        assert keys[block_id] is not None, f"block {block_id}: a token tag, no key"
    for block_id, primary in enumerate(keys):
        if primary is None:
            assert block_id not in secondary, f"block {block_id}: secondary keys, no primary"
            assert pool._num_tokens[block_id] == 0, f"uncached block {block_id} counts tokens"
            continue
        held = [primary, *secondary.get(block_id, ())]
        assert len(set(held)) == len(held), f"block {block_id} holds a key twice"
        for key in held:
            indexed = index.get(key)
            assert indexed is not None, f"block {block_id} holds a key missing from the index"
            assert indexed == block_id or block_id in more.get(key, ()), (
                f"block {block_id} holds a key the index maps elsewhere only"
            )
    for (block_id, key), stored in (pool._payloads or {}).items():
        assert key in (keys[block_id], *secondary.get(block_id, ())), (
            f"block {block_id}: a payload kept for a key it no longer holds"
        )
        assert stored.token_ids or stored.lora_name or stored.extra_keys is not None, (
            f"block {block_id}: a payload-free event kept"
        )
