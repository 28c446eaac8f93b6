"""Bugs found in a review of kvtier.core's block pool (each test fails on the code as
reviewed)."""

from __future__ import annotations

import signal

import pytest
from pool_helpers import cache_blocks, make_test_key

from kvtier.core.block_pool import BlockPool, PoolError


def test_insert_keys_with_tags_equals_insert_key_one_by_one() -> None:
    """A tag belongs to the entry whose key *became* the block's primary key.

    insert_keys([K, K], [b, b], tags={1: T}) must leave b untagged, as insert_key one by
    one does (the second entry is a no-op); it tagged b with T, vouching for KV the second
    entry never wrote (the token check then accepts the block).
    """
    key = make_test_key(1)
    one_by_one = BlockPool(4)
    [b] = one_by_one.allocate(1)
    one_by_one.insert_key(key, b, 16)
    one_by_one.insert_key(key, b, 16, tag=b"t" * 16)
    assert one_by_one.tag(b) is None

    batched = BlockPool(4)
    [b] = batched.allocate(1)
    batched.insert_keys([key, key], [b, b], [16, 16], {1: b"t" * 16})
    assert batched.tag(b) == one_by_one.tag(b)


def test_insert_keys_does_not_retag_a_block_that_already_held_the_key() -> None:
    """A later batch naming a key the block already holds must not replace its tag."""
    key = make_test_key(1)
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.insert_key(key, b, 16, tag=b"a" * 16)
    pool.insert_keys([key], [b], [16], {0: b"b" * 16})
    assert pool.tag(b, key) == b"a" * 16  # as insert_key(key, b, 16, tag=b"b"*16) leaves it


@pytest.mark.parametrize("op", ["touch", "free"])
def test_touch_and_free_refuse_a_bool_block_id(op: str) -> None:
    """True is not a block id: pin, insert_key, block() ... refuse it ("not an int");
    touch and free took it as block 1 and changed its reference count."""
    pool = BlockPool(4)
    pool.allocate(1)  # block 1, ref 1
    with pytest.raises(PoolError, match="True"):
        getattr(pool, op)([True])
    assert pool.ref_count(1) == 1
    pool.check_invariants()


@pytest.mark.parametrize("block_id", [-1, 4])
def test_tag_refuses_an_id_out_of_range(block_id: int) -> None:
    """tag(-1) read the last block's tag, as a list index does; key(), num_tokens() and
    secondary_keys() already refuse an id out of range."""
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.insert_key(make_test_key(1), b, 16, tag=b"t" * 16)
    with pytest.raises(PoolError, match=str(block_id)):
        pool.tag(block_id)


def test_check_invariants_catches_a_broken_back_link() -> None:
    """A wrong `_prev` link of the LRU queue passed check_invariants; the next removal of
    that block then unlinks the wrong neighbour (blocks vanish from the queue)."""
    pool = BlockPool(6)
    cache_blocks(pool, [make_test_key(i) for i in range(3)])  # queue: 4 5 3 2 1
    pool._free._prev[2] = 4  # type: ignore[attr-defined]  # should be 3
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_check_invariants_fails_on_a_cycle_instead_of_hanging() -> None:
    """Free-queue links forming a cycle that skips the sentinel made check_invariants
    loop forever (pool_checks lists the queue before the bounded queue check runs)."""
    pool = BlockPool(6)
    pool._free._next[3] = 2  # type: ignore[attr-defined]  # 1 -> 2 -> 3 -> 2 -> ...

    def timeout(signum: int, frame: object) -> None:
        raise TimeoutError("check_invariants did not return")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(AssertionError):
            pool.check_invariants()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
