"""Tests for kvtier.core.block_pool (SPEC §4): blocks, references and eviction order."""

from __future__ import annotations

import pytest
from pool_helpers import cache_blocks, free_order, make_pool, make_test_key, removed

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool, PoolError
from kvtier.core.events import AllCleared, BlockRemoved
from kvtier.core.keys import key_block_hash, key_group_id

# --- construction and the null block ------------------------------------------------


@pytest.mark.parametrize("num_blocks", [1, 0, -3, 2.0])
def test_rejects_fewer_than_two_blocks(num_blocks: int) -> None:
    """A pool needs an int of at least 2 blocks (the null block plus one)."""
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_new_pool_is_all_free_except_the_null_block() -> None:
    """Usable = N-1; the free queue holds 1..N-1 in order and never block 0."""
    pool = make_pool(6)
    assert pool.num_usable_blocks == 5
    assert pool.num_free() == 5
    assert free_order(pool) == [1, 2, 3, 4, 5]
    pool.check_invariants()


def test_null_block_is_never_allocated() -> None:
    """Allocating every usable block hands out 1..N-1 and then nothing more."""
    pool = make_pool(5)
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    assert not pool.can_allocate(1)
    with pytest.raises(PoolError):
        pool.allocate(1)
    assert pool.ref_count(NULL_BLOCK_ID) == 0


def test_touch_and_free_skip_the_null_block() -> None:
    """Null ids in touch/free change no ref count and never enter the free queue."""
    pool = make_pool(4)
    [block_id] = pool.allocate(1)
    pool.touch([NULL_BLOCK_ID, NULL_BLOCK_ID])
    pool.free([NULL_BLOCK_ID, block_id, NULL_BLOCK_ID])
    assert pool.ref_count(NULL_BLOCK_ID) == 0
    assert NULL_BLOCK_ID not in free_order(pool)
    assert pool.num_free() == 3
    pool.check_invariants()


def test_null_block_cannot_hold_a_key() -> None:
    """insert_key on block 0 raises and leaves the index empty."""
    pool = make_pool()
    with pytest.raises(PoolError, match="null"):
        pool.insert_key(make_test_key(1), NULL_BLOCK_ID, 16)
    assert pool.cached_block(make_test_key(1)) is None
    assert pool.block(NULL_BLOCK_ID).is_null
    assert not pool.block(1).is_null


@pytest.mark.parametrize("block_id", [-1, 8])
def test_insert_key_rejects_out_of_range_ids(block_id: int) -> None:
    """insert_key names the valid range when the block id is outside the pool."""
    with pytest.raises(PoolError, match="out of range"):
        make_pool(8).insert_key(make_test_key(1), block_id, 16)


def test_touch_rejects_a_negative_block_id() -> None:
    """touch([-1]) raises instead of unlinking the free queue's sentinel."""
    pool = make_pool(5)
    with pytest.raises(PoolError):
        pool.touch([-1])


def test_free_rejects_a_negative_block_id() -> None:
    """free([-1]) raises instead of dropping a reference of block N-1."""
    pool = make_pool(5)
    pool.allocate(4)
    with pytest.raises(PoolError):
        pool.free([-1])
    assert pool.ref_count(4) == 1


# --- allocate -----------------------------------------------------------------------


def test_allocate_error_names_the_numbers_and_changes_nothing() -> None:
    """Asking for more than is free raises PoolError naming both counts."""
    pool = make_pool(5)
    pool.allocate(2)
    with pytest.raises(PoolError, match=r"3.*2"):
        pool.allocate(3)
    assert pool.num_free() == 2
    assert free_order(pool) == [3, 4]


def test_allocate_pops_from_the_head_with_ref_count_one() -> None:
    """Allocated blocks are the head of the free queue, in order, each with ref 1."""
    pool = make_pool(8)
    pool.touch([1, 2, 3, 4, 5, 6, 7])
    pool.free([6, 2, 7])
    assert pool.allocate(2) == [7, 2]  # unhashed blocks: the last freed is at the head
    assert pool.ref_count(7) == pool.ref_count(2) == 1
    assert free_order(pool) == [6]


def test_allocating_a_cached_block_drops_every_key_with_one_event_each() -> None:
    """A reused cached block loses primary and secondary keys: one BlockRemoved per key."""
    pool = make_pool(3, events=True, medium="CPU")
    primary, second, third = make_test_key(1), make_test_key(2, 1), make_test_key(3)
    [block_id] = pool.allocate(1)
    for key in (primary, second, third):
        pool.insert_key(key, block_id, 16)
    pool.free([block_id])
    pool.allocate(1)  # the unhashed block 2 is taken first
    pool.take_events()
    assert pool.allocate(1) == [block_id]
    assert pool.take_events() == [
        removed(primary, 0, "CPU"),
        removed(second, 1, "CPU"),
        removed(third, 0, "CPU"),
    ]
    assert not pool.is_cached(block_id)
    assert pool.secondary_keys(block_id) == ()
    assert pool.num_tokens(block_id) == 0
    assert all(pool.cached_block(k) is None for k in (primary, second, third))
    pool.check_invariants()


def test_allocate_zero_blocks_returns_nothing() -> None:
    """allocate(0) is a no-op."""
    pool = make_pool()
    assert pool.allocate(0) == []
    assert pool.num_free() == 7


# --- eviction order -----------------------------------------------------------------


def test_eviction_is_least_recently_freed_first() -> None:
    """Cached blocks are evicted in the order they were freed."""
    pool = make_pool(4)
    blocks = pool.allocate(3)
    for i, block_id in enumerate(blocks):
        pool.insert_key(make_test_key(i), block_id, 16)
    pool.free(blocks)
    assert pool.allocate(3) == blocks


def test_touched_cached_block_leaves_the_queue_and_is_not_evicted() -> None:
    """touch takes a free cached block out of the queue; allocation passes it by."""
    pool = make_pool(5)
    a, b, c, d = cache_blocks(pool, [make_test_key(i) for i in range(4)])
    pool.touch([c])
    assert pool.ref_count(c) == 1
    assert c not in free_order(pool)
    assert pool.num_free() == 3
    assert sorted(pool.allocate(3)) == sorted([a, b, d])
    assert pool.cached_block(make_test_key(2)) == c
    pool.check_invariants()


def test_touch_then_free_moves_a_block_to_the_most_recent_end() -> None:
    """Touching A before pressure makes B the victim (SPEC §9 scenario 16, pool side)."""
    pool = make_pool(3)
    a, b = pool.allocate(2)
    pool.insert_key(make_test_key(0), a, 16)
    pool.insert_key(make_test_key(1), b, 16)
    pool.free([a, b])
    pool.touch([a])
    pool.free([a])
    assert pool.allocate(1) == [b]


def test_touch_on_a_referenced_block_only_counts() -> None:
    """touch of a block in use raises its ref count and leaves the free queue alone."""
    pool = make_pool(4)
    [block_id] = pool.allocate(1)
    before = free_order(pool)
    pool.touch([block_id, block_id])
    assert pool.ref_count(block_id) == 3
    assert free_order(pool) == before


def test_free_puts_unhashed_blocks_at_the_head_and_cached_at_the_tail() -> None:
    """After free, unhashed blocks are reused before any cached block."""
    pool = make_pool(6)
    cached = cache_blocks(pool, [make_test_key(0), make_test_key(1)])
    plain = pool.allocate(3)
    pool.free(plain)
    order = free_order(pool)
    assert set(order[:3]) == set(plain)
    assert order[3:] == cached[::-1]


def test_tail_first_free_evicts_prefix_tails_before_roots() -> None:
    """Hashed blocks freed tail-first join the tail in that order: the root is evicted last."""
    pool = make_pool(5)
    root, middle, tail = pool.allocate(3)
    for i, block_id in enumerate((root, middle, tail)):
        pool.insert_key(make_test_key(i), block_id, 16)
    pool.free([tail, middle, root])
    assert free_order(pool) == [4, tail, middle, root]
    assert pool.allocate(3) == [4, tail, middle]
    assert pool.cached_block(make_test_key(0)) == root


def test_free_keeps_a_block_with_references_left() -> None:
    """A block freed once with ref 2 stays out of the free queue."""
    pool = make_pool(4)
    [block_id] = pool.allocate(1)
    pool.touch([block_id])
    pool.free([block_id])
    assert pool.ref_count(block_id) == 1
    assert block_id not in free_order(pool)


def test_free_of_an_unreferenced_block_raises() -> None:
    """Freeing a block whose ref count is 0 raises PoolError naming it."""
    pool = make_pool(4)
    with pytest.raises(PoolError, match="block 2"):
        pool.free([2])
    pool.check_invariants()


def test_free_stopped_by_an_error_still_queues_the_blocks_before_it() -> None:
    """Cached blocks freed before the bad id are queued (batched, then flushed), in order."""
    pool = make_pool(6)
    blocks = cache_blocks(pool, [make_test_key(i) for i in range(3)])
    pool.touch(blocks)
    with pytest.raises(PoolError, match="block 5"):
        pool.free([blocks[2], blocks[0], 5, blocks[1]])
    assert free_order(pool)[-2:] == [blocks[2], blocks[0]]
    assert pool.ref_count(blocks[1]) == 1
    pool.check_invariants()


def test_free_keeps_the_order_of_mixed_cached_and_unhashed_blocks() -> None:
    """Unhashed blocks go to the head and cached ones to the tail, each in call order."""
    pool = make_pool(8)
    cached = cache_blocks(pool, [make_test_key(i) for i in range(3)])
    pool.touch(cached)
    scratch = pool.allocate(2)
    pool.free([cached[1], scratch[0], cached[2], scratch[1], cached[0]])
    order = free_order(pool)
    assert order[:2] == [scratch[1], scratch[0]]
    assert order[-3:] == [cached[1], cached[2], cached[0]]
    pool.check_invariants()


def test_num_free_counts_cached_blocks() -> None:
    """Evictable cached blocks count as free."""
    pool = make_pool(4)
    cache_blocks(pool, [make_test_key(0), make_test_key(1)])
    assert pool.num_free() == 3
    assert pool.can_allocate(3)
    assert not pool.can_allocate(4)


# --- iter_free_after ----------------------------------------------------------------


def test_iter_free_after_follows_the_eviction_order_after_the_cursor() -> None:
    """From the head for None; strictly after a free cursor; empty after the tail."""
    pool = make_pool(6)
    pool.touch([1, 2, 3, 4, 5])
    for i, block_id in enumerate((4, 1, 5)):
        pool.insert_key(make_test_key(i), block_id, 16)
    pool.free([4, 1, 5, 2])
    assert free_order(pool) == [2, 4, 1, 5]
    assert list(pool.iter_free_after(4)) == [1, 5]
    assert list(pool.iter_free_after(5)) == []


@pytest.mark.parametrize("cursor", [3, NULL_BLOCK_ID])
def test_iter_free_after_restarts_at_the_head_for_a_busy_cursor(cursor: int) -> None:
    """A cursor that left the free queue (or the null block) restarts from the head."""
    pool = make_pool(5)
    pool.touch([3])
    assert list(pool.iter_free_after(cursor)) == [1, 2, 4]


def test_free_after_lists_iter_free_after_to_a_limit_with_the_keys() -> None:
    """`free_after` (lazy mode's walk) is `iter_free_after` cut at `limit`, plus `keys`."""
    pool = make_pool(6)
    pool.touch([1, 2, 3, 4, 5])
    for i, block_id in enumerate((4, 1, 5)):
        pool.insert_key(make_test_key(i), block_id, 16)
    pool.free([4, 1, 5, 2])
    assert pool.free_after(None, 3) == ([2, 4, 1], [None, make_test_key(0), make_test_key(1)])
    assert pool.free_after(4, 9) == ([1, 5], [make_test_key(1), make_test_key(2)])
    assert pool.free_after(3, 1) == ([2], [None])  # busy cursor: from the head
    assert pool.free_after(5, 4) == ([], [])


# --- reset --------------------------------------------------------------------------


def test_reset_refuses_while_a_block_is_referenced() -> None:
    """reset returns False and changes no key, ref, order or event."""
    pool = make_pool(5, events=True)
    cached = cache_blocks(pool, [make_test_key(0), make_test_key(1)])
    [busy] = pool.allocate(1)
    pool.take_events()
    order = free_order(pool)
    assert pool.reset() is False
    assert pool.take_events() == []
    assert free_order(pool) == order
    assert pool.ref_count(busy) == 1
    assert pool.lookup([make_test_key(0), make_test_key(1)]) == cached


def test_reset_drops_every_key_and_emits_all_cleared() -> None:
    """With every block at ref 0, reset clears the index and frees the whole pool."""
    pool = make_pool(5, events=True, medium="DISK")
    keys = [make_test_key(0), make_test_key(1, 1)]
    [block_id] = cache_blocks(pool, keys[:1])
    pool.touch([block_id])
    pool.insert_key(keys[1], block_id, 16)
    pool.free([block_id])
    pool.take_events()
    assert pool.reset() is True
    (cleared,) = pool.take_events()
    assert cleared == AllCleared("DISK")
    assert sorted(cleared.removed, key=lambda e: e.group_id) == [  # primary and secondary
        BlockRemoved(key_block_hash(k), key_group_id(k), "DISK") for k in keys
    ]
    assert all(pool.cached_block(k) is None for k in keys)
    assert not pool.is_cached(block_id)
    assert pool.secondary_keys(block_id) == ()
    assert pool.num_free() == pool.num_usable_blocks
    assert free_order(pool) == [1, 2, 3, 4]
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    pool.check_invariants()


def test_reset_removes_a_key_once_per_block_that_held_it() -> None:
    """A key held by two blocks was stored twice: `AllCleared.removed` matches each
    `BlockStored` with one `BlockRemoved`, so a consumer counting copies ends at zero."""
    pool = make_pool(5, events=True, medium="CPU")
    key = make_test_key(0)
    first, second = pool.allocate(2)
    pool.insert_key(key, first, 16)
    pool.insert_key(key, second, 16)
    pool.free([first, second])
    stored = pool.take_events()
    assert pool.reset() is True
    (cleared,) = pool.take_events()
    removed = BlockRemoved(key_block_hash(key), key_group_id(key), "CPU")
    assert len(stored) == 2
    assert list(cleared.removed) == [removed, removed]
    pool.check_invariants()
