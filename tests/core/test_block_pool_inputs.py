"""Tests for kvtier.core.block_pool: bad arguments are refused clearly and change nothing;
a key given to a free block keeps the free queue (and its policy) consistent."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
from pool_helpers import cache_blocks, free_order, make_pool, make_test_key

from kvtier.core.block_pool import BlockPool, PoolError
from kvtier.core.free_queue import LRUFreeQueue
from kvtier.core.policies import EVICTION_POLICIES

# --- block ids ----------------------------------------------------------------------


@pytest.mark.parametrize("block_id", [8, 99])
def test_touch_and_free_name_an_id_past_the_end(block_id: int) -> None:
    """An id >= num_blocks raises PoolError naming it, not a bare IndexError."""
    pool = make_pool(8)
    with pytest.raises(PoolError, match=f"block id {block_id} out of range"):
        pool.touch([block_id])
    with pytest.raises(PoolError, match=f"block id {block_id} out of range"):
        pool.free([block_id])
    pool.check_invariants()


@pytest.mark.parametrize("block_id", [1.0, "1", None])
def test_touch_and_free_name_a_block_id_that_is_not_an_int(block_id: object) -> None:
    """A float, str or None block id raises PoolError naming it."""
    pool = make_pool(8)
    pool.allocate(2)
    with pytest.raises(PoolError, match="not an int"):
        pool.touch([block_id])  # type: ignore[list-item]
    with pytest.raises(PoolError, match="not an int"):
        pool.free([block_id])  # type: ignore[list-item]
    assert [pool.ref_count(b) for b in (1, 2)] == [1, 1]
    pool.check_invariants()


def test_touch_and_free_of_a_non_iterable_keep_their_type_error() -> None:
    """touch(5) is a TypeError about the argument, not about a block id."""
    pool = make_pool(8)
    with pytest.raises(TypeError, match="not iterable"):
        pool.touch(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not iterable"):
        pool.free(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("cursor", [8, -1])
def test_iter_free_after_rejects_an_out_of_range_cursor(cursor: int) -> None:
    """A cursor outside the pool raises PoolError (a negative one used to alias a block)."""
    with pytest.raises(PoolError, match="out of range"):
        list(make_pool(8).iter_free_after(cursor))


@pytest.mark.parametrize("num_blocks", [1.5, "2", None])
def test_allocate_names_a_count_that_is_not_an_int(num_blocks: object) -> None:
    """allocate refuses a non-int count with a TypeError naming it."""
    pool = make_pool(8)
    with pytest.raises(TypeError, match=f"cannot allocate {num_blocks!r}"):
        pool.allocate(num_blocks)  # type: ignore[arg-type]
    assert pool.num_free() == 7


SINGLE_BLOCK_GETTERS = [
    BlockPool.ref_count,
    BlockPool.key,
    BlockPool.num_tokens,
    BlockPool.is_cached,
    BlockPool.secondary_keys,
]


@pytest.mark.parametrize("block_id", [-1, 8])
@pytest.mark.parametrize("getter", SINGLE_BLOCK_GETTERS, ids=lambda f: f.__name__)
def test_block_getters_name_an_id_out_of_range(
    getter: Callable[[BlockPool, int], object], block_id: int
) -> None:
    """Each single-block getter raises PoolError naming the id and the valid range.

    A negative id used to return another block's value (here block 7's: ref 1, a key, 16
    tokens, cached) or, for secondary_keys, an empty tuple; an id past the end raised a
    bare IndexError (secondary_keys: an empty tuple again).
    """
    pool = make_pool(8)
    pool.allocate(7)
    pool.insert_key(make_test_key(1), 7, 16)
    pool.insert_key(make_test_key(2), 7, 16)  # a secondary key
    with pytest.raises(PoolError, match=re.escape(f"block id {block_id} out of range [0, 8)")):
        getter(pool, block_id)
    pool.check_invariants()


# --- insert_key arguments -----------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [-1, 2**31, 2**40, 1.5, True])
def test_insert_key_rejects_a_bad_token_count_and_changes_nothing(num_tokens: object) -> None:
    """A token count that is negative, not an int or beyond int32 names itself.

    A count too large for the token array used to leave the key on the block but missing
    from the index.
    """
    pool = make_pool(8)
    [block_id] = pool.allocate(1)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.insert_key(make_test_key(1), block_id, num_tokens)  # type: ignore[arg-type]
    assert pool.key(block_id) is None
    assert pool.cached_block(make_test_key(1)) is None
    pool.check_invariants()


@pytest.mark.parametrize("key", ["abc", 5, None, bytearray(b"k" * 36)])
def test_insert_key_rejects_a_key_that_is_not_bytes(key: object) -> None:
    """Keys are bytes; anything else is refused, naming it."""
    pool = make_pool(8)
    [block_id] = pool.allocate(1)
    with pytest.raises(TypeError, match="expected bytes"):
        pool.insert_key(key, block_id, 16)  # type: ignore[arg-type]
    assert pool.key(block_id) is None
    pool.check_invariants()


def test_insert_keys_with_a_bad_count_leaves_nothing_half_done() -> None:
    """The batched insert refuses a bad count like insert_key, before changing the block."""
    pool = make_pool(8)
    block_ids = pool.allocate(2)
    keys = [make_test_key(1), make_test_key(2)]
    with pytest.raises(ValueError, match="num_tokens"):
        pool.insert_keys(keys, block_ids, [16, 2**40])
    assert pool.key(block_ids[0]) == keys[0]
    assert pool.key(block_ids[1]) is None
    assert pool.cached_block(keys[1]) is None
    pool.check_invariants()


# --- free queue size ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["lru-queue", *sorted(EVICTION_POLICIES)])
def test_a_free_queue_made_for_fewer_blocks_is_refused(name: str) -> None:
    """A queue or policy sized for a smaller pool is a ValueError naming the size."""
    queue = LRUFreeQueue(4) if name == "lru-queue" else EVICTION_POLICIES[name](4)
    with pytest.raises(ValueError, match="num_blocks=10"):
        BlockPool(10, free_queue=queue)


@pytest.mark.parametrize("name", ["lru-queue", *sorted(EVICTION_POLICIES)])
@pytest.mark.parametrize("size", [9, 11, 1000])
def test_a_free_queue_made_for_another_size_is_refused(name: str, size: int) -> None:
    """Regression: a queue one block short was accepted (LRU's sentinel node became a
    block: `allocate(9)` gave block 9 nine times), and a larger one too (S3-FIFO then
    sized its small FIFO for the larger pool)."""
    queue = LRUFreeQueue(size) if name == "lru-queue" else EVICTION_POLICIES[name](size)
    with pytest.raises(ValueError, match=f"made for {size} blocks, not the pool's 10"):
        BlockPool(10, free_queue=queue)


# --- a key given to a free block ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_a_free_block_given_a_key_is_queued_as_most_recently_used(name: str) -> None:
    """insert_key on a free, unhashed block moves it behind the unhashed blocks.

    It used to stay among the unhashed blocks, where every policy but LRU holds no key:
    their check_invariants failed and the block was reused before older unhashed ones.
    """
    policy = EVICTION_POLICIES[name](8)
    pool = BlockPool(8, free_queue=policy)
    cache_blocks(pool, [make_test_key(1)])  # block 1, cached and free
    pool.insert_key(make_test_key(2), 3, 16)  # block 3: free and unhashed until now
    pool.check_invariants()
    assert free_order(pool)[:4] == [2, 4, 5, 6]
    assert set(free_order(pool)[-2:]) == {1, 3}
    assert pool.allocate(5) == [2, 4, 5, 6, 7]
    pool.check_invariants()
    assert pool.cached_block(make_test_key(2)) == 3


def test_a_free_cached_block_given_another_key_stays_in_place() -> None:
    """A secondary key on a free cached block does not move it."""
    pool = make_pool(6)
    cache_blocks(pool, [make_test_key(1), make_test_key(2)])
    before = free_order(pool)
    pool.insert_key(make_test_key(3), 1, 16)
    assert free_order(pool) == before
    assert pool.secondary_keys(1) == (make_test_key(3),)
    pool.check_invariants()


def test_insert_keys_refuses_what_insert_key_refuses() -> None:
    """Regression: the batched fast path stored a str key and a bool token count, and
    failed on a float block id with a bare TypeError naming nothing."""
    pool = BlockPool(8)
    (block_id,) = pool.allocate(1)
    with pytest.raises(TypeError, match="expected bytes"):
        pool.insert_keys(["abc"], [block_id], [16])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="num_tokens"):
        pool.insert_keys([make_test_key(1)], [block_id], [True])
    with pytest.raises(PoolError, match="not an int"):
        pool.insert_keys([make_test_key(1)], [1.5], [16])  # type: ignore[list-item]
    assert pool.key(block_id) is None
    pool.check_invariants()


@pytest.mark.parametrize("query", ["allocate", "can_allocate"])
def test_allocation_counts_that_are_bools_floats_or_negative_are_refused(query: str) -> None:
    """Regression: `can_allocate(True)` and `can_allocate(-5)` answered True, though
    `allocate` refuses both; numpy counts work in both."""
    pool = BlockPool(8)
    call = getattr(pool, query)
    with pytest.raises(TypeError, match="cannot allocate True blocks"):
        call(True)
    with pytest.raises(TypeError, match=r"cannot allocate 2\.0 blocks"):
        call(2.0)
    with pytest.raises(PoolError, match=r"negative number of blocks \(-5\)"):
        call(-5)
    num_free = pool.num_free()  # nothing was taken
    assert pool.can_allocate(np.int64(num_free))
    assert not pool.can_allocate(np.int64(num_free + 1))
    assert len(pool.allocate(np.int64(2))) == 2


def test_insert_keys_takes_numpy_token_counts() -> None:
    """numpy counts worked before the fast path checked types, and still do."""
    pool = BlockPool(8)
    block_ids = pool.allocate(2)
    pool.insert_keys([make_test_key(1), make_test_key(2)], block_ids, np.array([16, 8]))
    assert [pool.num_tokens(b) for b in block_ids] == [16, 8]
    pool.check_invariants()


def test_insert_key_takes_a_numpy_token_count() -> None:
    """Regression: `insert_key` refused `np.int64(16)` with "num_tokens must be an int in
    [0, ...], got np.int64(16)" (an int in range), though `insert_keys`, `allocate`,
    `touch` and `free` take numpy integers."""
    pool = BlockPool(8)
    (block_id,) = pool.allocate(1)
    pool.insert_key(make_test_key(1), block_id, np.int64(16))  # type: ignore[arg-type]
    assert pool.num_tokens(block_id) == 16
    assert type(pool.num_tokens(block_id)) is int
    with pytest.raises(ValueError, match="got -1"):
        pool.insert_key(make_test_key(2), block_id, np.int64(-1))  # type: ignore[arg-type]
    pool.check_invariants()
