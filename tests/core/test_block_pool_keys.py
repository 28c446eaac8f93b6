"""Tests for kvtier.core.block_pool (SPEC §4): the key index and its events."""

from __future__ import annotations

import pytest
from pool_helpers import cache_blocks, make_pool, make_test_key

from kvtier.core.block_pool import NULL_BLOCK_ID, PoolError
from kvtier.core.events import BlockStored
from kvtier.core.keys import key_block_hash

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


def test_kept_payloads_last_while_the_block_holds_the_key() -> None:
    """`keep_payloads`: a key's payload-carrying event is kept until the block loses that
    key (secondary key dropped, keys discarded, block evicted or reused, reset); a
    payload-free insertion keeps nothing, and nothing is kept without events."""
    plain = make_pool(4)
    plain.keep_payloads()  # without events: nothing to keep
    assert plain.payload(1, make_test_key(1)) is None
    pool = make_pool(4, events=True)
    pool.keep_payloads()
    a, b, c = pool.allocate(3)
    keys = [make_test_key(i) for i in range(5)]

    def stored(i: int) -> BlockStored:
        return BlockStored(key_block_hash(keys[i]), 0, 16, token_ids=(i,) * 16)

    pool.insert_key(keys[0], a, 16, stored(0))
    pool.insert_key(keys[1], a, 8, stored(1))  # secondary
    pool.insert_key(keys[2], b, 16)  # payload-free
    pool.insert_key(keys[3], c, 16, stored(3))
    assert pool.payload(a, keys[0]) == stored(0)
    assert pool.payload(a, keys[1]) == stored(1)
    assert pool.payload(b, keys[2]) is None
    assert pool.payload(b, keys[0]) is None
    pool.discard_secondary_key(a, keys[1])
    assert pool.payload(a, keys[1]) is None
    assert pool.payload(a, keys[0]) == stored(0)
    pool.discard_keys(a)
    assert pool.payload(a, keys[0]) is None
    pool.insert_key(keys[0], a, 16)  # held again, stored without a payload: none
    assert pool.payload(a, keys[0]) is None
    pool.free([c, b, a])
    pool.evict_keys(c)
    assert pool.payload(c, keys[3]) is None
    pool.touch([a])
    pool.insert_key(keys[4], a, 8, stored(4))
    pool.free([a])
    assert pool.reset()
    assert pool.payload(a, keys[4]) is None


def test_check_invariants_finds_a_payload_its_block_no_longer_holds() -> None:
    """A kept payload outliving its key (a removal path that forgot it) is reported."""
    pool = make_pool(4, events=True)
    pool.keep_payloads()
    (block,) = pool.allocate(1)
    key = make_test_key(7)
    pool.insert_key(key, block, 16, BlockStored(key_block_hash(key), 0, 16, token_ids=(7,) * 16))
    pool.check_invariants()
    assert pool._payloads is not None
    pool._payloads[block, make_test_key(8)] = pool._payloads[block, key]
    with pytest.raises(AssertionError, match="no longer holds"):
        pool.check_invariants()
