"""Block pool edges a mutation run found untested (each test fails when its rule or check
is dropped): the smallest pool, a bool block id given to `touch`, a payload made of extra
keys alone, and two corruptions only one check of `check_invariants` sees."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from pool_helpers import cache_blocks, make_pool, make_test_key

from kvtier.core.block_pool import BlockPool, PoolError
from kvtier.core.events import BlockStored
from kvtier.core.free_queue import LRUFreeQueue
from kvtier.core.keys import key_block_hash


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_a_pool_needs_a_block_besides_the_null_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
        BlockPool(num_blocks)


def test_touch_refuses_false_as_a_block_id() -> None:
    """False equals the null block's id 0, which `touch` skips; a bool is a caller's bug
    (a mask passed for ids), refused as `free` refuses it, not taken for the null block."""
    pool = make_pool(4)
    with pytest.raises(PoolError, match="not an int"):
        pool.touch([False])
    with pytest.raises(PoolError, match="not an int"):
        pool.free([False])
    pool.touch([0])  # the null block itself is skipped
    pool.check_invariants()


def test_a_payload_of_extra_keys_alone_is_kept() -> None:
    """An event whose only payload is the request's extra keys (no tokens, no LoRA name)
    is kept: a demotion's disk event needs them to name the block's KV."""
    pool = make_pool(4, events=True)
    pool.keep_payloads()
    (block_id,) = pool.allocate(1)
    key = make_test_key(1)
    stored = BlockStored(key_block_hash(key), 0, 16, extra_keys=("image-7",))
    pool.insert_key(key, block_id, 16, stored)
    assert pool.payload(block_id, key) == stored
    pool.check_invariants()


def test_check_refuses_an_index_listing_one_holder_twice() -> None:
    """Key 0's further blocks repeat the block the index already names."""
    pool = make_pool(5)
    [cached] = cache_blocks(pool, [make_test_key(0)])
    pool.check_invariants()
    pool._more_blocks[make_test_key(0)] = [cached]
    with pytest.raises(AssertionError, match=f"index lists block {cached} twice"):
        pool.check_invariants()


class _RepeatingQueue(LRUFreeQueue):
    """LRU whose listing, once `repeat` is set, yields its first block twice in place of
    its second one."""

    repeat = False

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        blocks = list(super().iter_after(cursor))
        if self.repeat:
            blocks[1] = blocks[0]
        return iter(blocks)


def test_check_refuses_a_free_queue_listing_a_block_twice() -> None:
    """An eviction order that yields one free block twice and skips another, its count
    right (a policy's `iter_after` that chains its lists wrongly); the queue's own links
    are sound, so only the pool's check sees it."""
    queue = _RepeatingQueue(4)
    pool = BlockPool(4, free_queue=queue)
    pool.check_invariants()
    queue.repeat = True
    with pytest.raises(AssertionError, match="a block is queued twice"):
        pool.check_invariants()


def test_check_refuses_a_block_holding_its_primary_key_again_as_secondary() -> None:
    """The index is consistent (one holder), but the block lists key 0 twice."""
    pool = make_pool(5)
    [cached] = cache_blocks(pool, [make_test_key(0)])
    pool._secondary[cached] = [make_test_key(0)]
    with pytest.raises(AssertionError, match=f"block {cached} holds a key twice"):
        pool.check_invariants()


def test_check_refuses_a_kept_event_without_a_payload() -> None:
    """`keep_payloads` keeps only events with tokens, a LoRA name or extra keys."""
    pool = make_pool(4, events=True)
    pool.keep_payloads()
    (block_id,) = pool.allocate(1)
    key = make_test_key(1)
    pool.insert_key(key, block_id, 16)
    assert pool._payloads is not None
    pool._payloads[block_id, key] = BlockStored(key_block_hash(key), 0, 16)
    with pytest.raises(AssertionError, match="a payload-free event kept"):
        pool.check_invariants()


def _more_blocks_of_an_unindexed_key(pool: BlockPool, busy: int) -> None:
    pool._more_blocks[make_test_key(99)] = [busy]


def _tag_on_an_uncached_block(pool: BlockPool, busy: int) -> None:
    pool._tags[busy] = b"t" * 16


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_more_blocks_of_an_unindexed_key, "further blocks of a key missing from the index"),
        (_tag_on_an_uncached_block, "a token tag, no key"),
    ],
)
def test_check_refuses_state_kept_for_a_key_nobody_holds(
    corrupt: Callable[[BlockPool, int], None], message: str
) -> None:
    """Each corruption is seen by its own check alone (nothing else refers to it)."""
    pool = make_pool(5)
    cache_blocks(pool, [make_test_key(0)])
    [busy] = pool.allocate(1)
    pool.check_invariants()
    corrupt(pool, busy)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()


def test_a_key_of_zero_tokens_is_accepted() -> None:
    """`num_tokens` may be 0 (the documented range is [0, 2**31 - 1])."""
    pool = make_pool(4)
    (block_id,) = pool.allocate(1)
    pool.insert_key(make_test_key(1), block_id, 0)
    assert pool.cached_block(make_test_key(1)) == block_id
    pool.check_invariants()


def test_secondary_keys_of_names_every_block_asked_about_that_holds_some() -> None:
    """Blocks a and c hold secondary keys, b none: the answer names a and c, the last id
    asked about included."""
    pool = make_pool(5)
    a, b, c = pool.allocate(3)
    for block_id, i in ((a, 0), (b, 1), (c, 2)):
        pool.insert_key(make_test_key(i), block_id, 16)
    pool.insert_key(make_test_key(10), a, 8)
    pool.insert_key(make_test_key(12), c, 8)
    assert pool.secondary_keys_of([a, b, c]) == {a: (make_test_key(10),), c: (make_test_key(12),)}
    assert pool.secondary_keys_of([c]) == {c: (make_test_key(12),)}
