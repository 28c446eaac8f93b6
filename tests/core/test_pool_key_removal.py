"""The block pool's key removal (`PoolKeyRemoval`): which keys and holders go, which
stay, the `BlockRemoved` events, and where the block is queued after (SPEC §4: a block
that loses its keys is reused first). `check_invariants()` after each operation."""

from __future__ import annotations

import dataclasses

import pytest
from pool_helpers import cache_blocks, free_order, make_pool, make_test_key, removed

from kvtier.core.events import BlockStored
from kvtier.core.keys import key_block_hash
from kvtier.core.pool_checks import PoolError


def test_discard_secondary_key_drops_that_key_only_and_records_its_removal() -> None:
    pool = make_pool(events=True, medium="CPU")
    a, b, c = (make_test_key(i) for i in range(3))
    [block] = pool.allocate(1)
    for key in (a, b, c):
        pool.insert_key(key, block, 16)
    pool.take_events()
    pool.discard_secondary_key(block, b)
    pool.check_invariants()
    assert (pool.key(block), list(pool.secondary_keys(block))) == (a, [c])
    assert pool.cached_block(b) is None  # not left mapped to the block
    assert pool.cached_block(c) == pool.cached_block(a) == block
    assert pool.take_events() == [removed(b, medium="CPU")]
    pool.discard_secondary_key(block, c)  # the last secondary key
    pool.check_invariants()
    assert list(pool.secondary_keys(block)) == []
    assert pool.take_events() == [removed(c, medium="CPU")]


def test_discard_secondary_key_leaves_a_key_not_held_as_secondary() -> None:
    """The primary key, or a key the block does not hold, stays as it was: no error,
    no event."""
    pool = make_pool(events=True)
    a, b, other = (make_test_key(i) for i in range(3))
    [block] = pool.allocate(1)
    pool.insert_key(a, block, 16)
    pool.insert_key(b, block, 16)
    pool.take_events()
    pool.discard_secondary_key(block, a)
    pool.discard_secondary_key(block, other)
    pool.check_invariants()
    assert (pool.key(block), list(pool.secondary_keys(block))) == (a, [b])
    assert pool.cached_block(a) == block
    assert pool.take_events() == []


def test_a_holder_that_goes_leaves_the_key_s_other_holders() -> None:
    """A key in two blocks: dropping the keys of either leaves the other one its only
    holder (not a block that no longer holds it)."""
    pool = make_pool()
    key = make_test_key(0)
    first, second, third = pool.allocate(3)
    for block in (first, second, third):
        pool.insert_key(key, block, 16)
    assert pool.cached_blocks(key) == [first, second, third]
    pool.discard_keys(second)  # one of the further holders
    pool.check_invariants()
    assert pool.cached_blocks(key) == [first, third]
    pool.discard_keys(first)  # the indexed holder
    pool.check_invariants()
    assert pool.cached_blocks(key) == [third]


def test_release_evicted_refuses_a_block_with_another_reference() -> None:
    pool = make_pool()
    [block] = cache_blocks(pool, [make_test_key(0)])
    pool.pin([block])
    pool.touch([block])  # a request's hit on the block being demoted
    with pytest.raises(PoolError, match="has 2 references; release_evicted drops the last one"):
        pool.release_evicted(block)
    pool.check_invariants()
    assert pool.ref_count(block) == 2
    assert pool.key(block) == make_test_key(0)


def test_release_evicted_frees_the_block_to_be_reused_first() -> None:
    pool = make_pool(num_blocks=4)
    blocks = cache_blocks(pool, [make_test_key(i) for i in range(3)])
    pool.pin([blocks[1]])
    pool.release_evicted(blocks[1])
    pool.check_invariants()
    assert pool.ref_count(blocks[1]) == 0
    assert pool.key(blocks[1]) is None
    assert free_order(pool)[0] == blocks[1]


def test_a_stored_event_the_pool_makes_carries_no_payload() -> None:
    """`insert_key` without the storing request's event: the minimal one names no
    parent (None, not an empty hash a router would look up), no tokens, no extra keys."""
    pool = make_pool(events=True)
    key = make_test_key(0)
    [block] = pool.allocate(1)
    pool.insert_key(key, block, 16)
    pool.check_invariants()
    [event] = pool.take_events()
    assert event == BlockStored(key_block_hash(key), 0, 16)
    assert event.parent_block_hash is None
    assert event.token_ids == ()
    assert event.extra_keys is None


def test_events_are_frozen_records() -> None:
    """A drained event cannot be changed by one consumer under another."""
    pool = make_pool(events=True)
    [block] = cache_blocks(pool, [make_test_key(0)])
    pool.discard_keys(block)
    pool.check_invariants()
    stored, gone = pool.take_events()
    for event in (stored, gone):
        with pytest.raises(dataclasses.FrozenInstanceError):
            event.group_id = 1  # type: ignore[misc]
    assert len({gone, removed(make_test_key(0))}) == 1  # hashable, equal by value
