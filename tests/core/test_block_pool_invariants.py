"""Tests for kvtier.core.block_pool: `check_invariants` catches each kind of corruption."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pool_helpers import cache_blocks, make_test_key

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.policies import ARCPolicy

# --- check_invariants ---------------------------------------------------------------


def corrupt_negative_ref(pool: BlockPool, busy: int, cached: int) -> None:
    pool._refs[busy] = -1


def corrupt_free_block_ref(pool: BlockPool, busy: int, cached: int) -> None:
    pool._refs[cached] = 1


def corrupt_busy_block_ref(pool: BlockPool, busy: int, cached: int) -> None:
    pool._refs[busy] = 0


def corrupt_index_target(pool: BlockPool, busy: int, cached: int) -> None:
    pool._index[make_test_key(0)] = busy


def corrupt_dropped_primary(pool: BlockPool, busy: int, cached: int) -> None:
    pool._keys[cached] = None


def corrupt_unindexed_key(pool: BlockPool, busy: int, cached: int) -> None:
    pool._keys[busy] = make_test_key(99)


def corrupt_orphan_secondary(pool: BlockPool, busy: int, cached: int) -> None:
    pool._secondary[busy] = [make_test_key(98)]


def corrupt_null_in_queue(pool: BlockPool, busy: int, cached: int) -> None:
    pool._free.push_cached(NULL_BLOCK_ID)


def corrupt_null_ref(pool: BlockPool, busy: int, cached: int) -> None:
    pool._refs[NULL_BLOCK_ID] = 1


def corrupt_queue_length(pool: BlockPool, busy: int, cached: int) -> None:
    pool._free._len += 1  # type: ignore[attr-defined]


def corrupt_uncached_token_count(pool: BlockPool, busy: int, cached: int) -> None:
    pool._num_tokens[busy] = 16


def corrupt_key_held_twice(pool: BlockPool, busy: int, cached: int) -> None:
    pool._secondary[cached] = [make_test_key(0)]
    pool._more_blocks[make_test_key(0)] = [cached]


def corrupt_key_mapped_to_another_holder(pool: BlockPool, busy: int, cached: int) -> None:
    # Both blocks hold key 0 and the counts agree, but the index lists `cached` twice.
    pool._keys[busy] = make_test_key(0)
    pool._more_blocks[make_test_key(0)] = [cached]


def corrupt_empty_more_blocks(pool: BlockPool, busy: int, cached: int) -> None:
    pool._more_blocks[make_test_key(0)] = []


def corrupt_policy_lists(pool: BlockPool, busy: int, cached: int) -> None:
    pool._free.target_t1 = -1.0  # type: ignore[attr-defined]  # only ARC's own check sees it


@pytest.mark.parametrize(
    "corrupt",
    [
        corrupt_negative_ref,
        corrupt_free_block_ref,
        corrupt_busy_block_ref,
        corrupt_index_target,
        corrupt_dropped_primary,
        corrupt_unindexed_key,
        corrupt_orphan_secondary,
        corrupt_null_in_queue,
        corrupt_null_ref,
        corrupt_queue_length,
        corrupt_uncached_token_count,
        corrupt_key_held_twice,
        corrupt_key_mapped_to_another_holder,
        corrupt_empty_more_blocks,
        corrupt_policy_lists,
    ],
)
def test_check_invariants_catches_corruption(
    corrupt: Callable[[BlockPool, int, int], None],
) -> None:
    """Each deliberately broken private field makes check_invariants fail.

    The pool checks its eviction policy too (`corrupt_policy_lists`, on an ARC pool).
    """
    policy = ARCPolicy(5) if corrupt is corrupt_policy_lists else None
    pool = BlockPool(5, free_queue=policy)
    [cached] = cache_blocks(pool, [make_test_key(0)])
    [busy] = pool.allocate(1)
    pool.check_invariants()
    corrupt(pool, busy, cached)
    with pytest.raises(AssertionError):
        pool.check_invariants()
