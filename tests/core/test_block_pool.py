"""Tests for kvtier.core.block_pool (SPEC §4)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool, PoolError
from kvtier.core.events import AllCleared, BlockRemoved, BlockStored
from kvtier.core.keys import Key, key_block_hash, make_key


def make_pool(num_blocks: int = 8, events: bool = False, medium: str | None = None) -> BlockPool:
    return BlockPool(num_blocks, medium=medium, record_events=events)


def make_test_key(i: int, group_id: int = 0) -> Key:
    return make_key(hashlib.sha256(str(i).encode()).digest(), group_id)


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.iter_free_after(None))


def cache_blocks(pool: BlockPool, keys: list[Key]) -> list[int]:
    """Allocate one block per key, give it the key, and free them tail-first."""
    block_ids = pool.allocate(len(keys))
    for key, block_id in zip(keys, block_ids, strict=True):
        pool.insert_key(key, block_id, 16)
    pool.free(reversed(block_ids))
    return block_ids


def removed(key: Key, group_id: int = 0, medium: str | None = None) -> BlockRemoved:
    return BlockRemoved(key_block_hash(key), group_id, medium)


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


def test_num_free_counts_cached_blocks() -> None:
    """Evictable cached blocks count as free."""
    pool = make_pool(4)
    cache_blocks(pool, [make_test_key(0), make_test_key(1)])
    assert pool.num_free() == 3
    assert pool.can_allocate(3)
    assert not pool.can_allocate(4)


# --- keys ---------------------------------------------------------------------------


def test_primary_and_secondary_keys_keep_the_primary_token_count() -> None:
    """The first key is primary with its token count; later keys are secondary."""
    pool = make_pool()
    [block_id] = pool.allocate(1)
    primary, partial = make_test_key(1), make_test_key(2)
    pool.insert_key(primary, block_id, 16)
    pool.insert_key(partial, block_id, 8)
    view = pool.block(block_id)
    assert (view.key, view.num_tokens, tuple(view.secondary_keys)) == (primary, 16, (partial,))
    assert view.ref_count == 1
    assert pool.is_cached(block_id)
    assert pool.cached_block(primary) == pool.cached_block(partial) == block_id


def test_reinserting_a_held_key_changes_nothing() -> None:
    """insert_key of a key the block already holds emits nothing and adds nothing."""
    pool = make_pool(events=True)
    [block_id] = pool.allocate(1)
    primary, secondary = make_test_key(1), make_test_key(2)
    pool.insert_key(primary, block_id, 16)
    pool.insert_key(secondary, block_id, 16)
    pool.take_events()
    pool.insert_key(primary, block_id, 4)
    pool.insert_key(secondary, block_id, 4)
    assert pool.take_events() == []
    assert pool.num_tokens(block_id) == 16
    assert pool.secondary_keys(block_id) == (secondary,)
    assert pool.cached_blocks(primary) == [block_id]
    pool.check_invariants()


def test_a_key_held_by_several_blocks_stays_visible_until_the_last_goes() -> None:
    """No dedup: evicting one holder keeps the key cached through the others."""
    pool = make_pool(5)
    shared = make_test_key(7)
    a, b, c = pool.allocate(3)
    pool.insert_key(shared, a, 16)
    pool.insert_key(make_test_key(8), b, 16)
    pool.insert_key(shared, b, 16)  # secondary on b
    pool.insert_key(shared, c, 16)
    assert set(pool.cached_blocks(shared)) == {a, b, c}
    assert pool.cached_block(shared) in {a, b, c}
    pool.free([a, c, b])
    pool.allocate(1)  # the unhashed block 4
    holders = {a, b, c}
    for victim in (a, c):
        assert pool.allocate(1) == [victim]
        holders.discard(victim)
        assert set(pool.cached_blocks(shared)) == holders
        assert pool.cached_block(shared) in holders
        assert pool.lookup([shared]) == [pool.cached_block(shared)]
        pool.check_invariants()
    pool.allocate(1)
    assert pool.cached_blocks(shared) == []
    assert pool.cached_block(shared) is None
    pool.check_invariants()


@pytest.mark.parametrize("events", [False, True])
def test_insert_keys_equals_insert_key_one_by_one(events: bool) -> None:
    k = [make_test_key(i) for i in range(5)]
    # New keys; a key already held by another block; a second key for a block; a repeat.
    batch = [(k[0], 1, 16), (k[1], 2, 16), (k[0], 3, 8), (k[2], 1, 4), (k[1], 2, 16)]
    pools = [make_pool(events=events), make_pool(events=events)]
    for pool in pools:
        pool.allocate(3)
    for key, block_id, num_tokens in batch:
        pools[0].insert_key(key, block_id, num_tokens)
    keys, block_ids, counts = map(list, zip(*batch, strict=True))
    pools[1].insert_keys(keys, block_ids, counts)
    for pool in pools:
        pool.check_invariants()
    one, many = pools
    for block_id in range(1, 4):
        assert many.key(block_id) == one.key(block_id)
        assert many.num_tokens(block_id) == one.num_tokens(block_id)
        assert many.secondary_keys(block_id) == one.secondary_keys(block_id)
    assert many.cached_blocks(k[0]) == one.cached_blocks(k[0])
    assert many.take_events() == one.take_events()
    assert many.token_counts([1, 2, 3]) == [16, 16, 8]
    assert many.secondary_keys_of([1, 2, 3]) == {1: (k[2],)}


def test_insert_keys_rejects_unequal_lengths_and_bad_ids() -> None:
    pool = make_pool()
    pool.allocate(2)
    with pytest.raises(ValueError, match="2 keys, 1 blocks and 2 token counts"):
        pool.insert_keys([make_test_key(0), make_test_key(1)], [1], [16, 16])
    with pytest.raises(PoolError, match="block 0 cannot hold a key"):
        pool.insert_keys([make_test_key(0)], [NULL_BLOCK_ID], [16])
    assert pool.secondary_keys_of([1, 2]) == {}


def test_cached_blocks_of_an_unknown_key_is_empty() -> None:
    """An absent key maps to no block."""
    pool = make_pool()
    assert pool.cached_block(make_test_key(1)) is None
    assert pool.cached_blocks(make_test_key(1)) == []


def test_lookup_returns_only_the_leading_cached_run() -> None:
    """lookup stops at the first miss even when later keys are cached."""
    pool = make_pool()
    keys = [make_test_key(i) for i in range(4)]
    block_ids = pool.allocate(4)
    for key, block_id in zip(keys, block_ids, strict=True):
        if key != keys[2]:
            pool.insert_key(key, block_id, 16)
    assert pool.lookup(keys) == block_ids[:2]
    assert pool.lookup(keys[3:]) == block_ids[3:]
    assert pool.lookup(keys[2:]) == []
    assert pool.lookup([]) == []


def test_keys_of_different_groups_are_distinct() -> None:
    """One block hash in two groups gives two independent keys."""
    pool = make_pool()
    a, b = pool.allocate(2)
    pool.insert_key(make_test_key(1, 0), a, 16)
    pool.insert_key(make_test_key(1, 1), b, 16)
    assert pool.cached_block(make_test_key(1, 0)) == a
    assert pool.cached_block(make_test_key(1, 1)) == b


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
    assert pool.take_events() == [AllCleared("DISK")]
    assert all(pool.cached_block(k) is None for k in keys)
    assert not pool.is_cached(block_id)
    assert pool.secondary_keys(block_id) == ()
    assert pool.num_free() == pool.num_usable_blocks
    assert free_order(pool) == [1, 2, 3, 4]
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    pool.check_invariants()


# --- events -------------------------------------------------------------------------


def test_take_events_drains_the_queue() -> None:
    """A second take_events returns nothing new."""
    pool = make_pool(events=True)
    [block_id] = pool.allocate(1)
    pool.insert_key(make_test_key(1, 2), block_id, 12)
    assert pool.take_events() == [BlockStored(key_block_hash(make_test_key(1)), 2, 12)]
    assert pool.take_events() == []


def test_insert_key_records_the_given_stored_event() -> None:
    """A caller-built BlockStored is queued as is."""
    pool = make_pool(events=True)
    [block_id] = pool.allocate(1)
    key = make_test_key(1)
    stored = BlockStored(key_block_hash(key), 0, 16, token_ids=(1, 2), medium="CPU")
    pool.insert_key(key, block_id, 16, stored)
    assert pool.take_events() == [stored]


def test_events_off_records_nothing() -> None:
    """Without record_events, inserts, evictions and reset queue no event."""
    pool = make_pool(3)
    cache_blocks(pool, [make_test_key(0), make_test_key(1)])
    pool.allocate(2)
    pool.free([1, 2])
    assert pool.reset() is True
    assert pool.take_events() == []


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
    ],
)
def test_check_invariants_catches_corruption(
    corrupt: Callable[[BlockPool, int, int], None],
) -> None:
    """Each deliberately broken private field makes check_invariants fail."""
    pool = make_pool(5)
    [cached] = cache_blocks(pool, [make_test_key(0)])
    [busy] = pool.allocate(1)
    pool.check_invariants()
    corrupt(pool, busy, cached)
    with pytest.raises(AssertionError):
        pool.check_invariants()
