"""Set-dueling rules a mutation run found untested (each test fails when its rule is
changed): `max_frequency` reaches both the LFU-DA order and its shadow, the shadows
sample the share of keys the rate says, a tie keeps the order, LFU-DA ages on any
eviction while it picks the victims, a reset keeps the order, a cursor not queued is
refused, and the check compares the two orders."""

from __future__ import annotations

import pytest
from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.core.policies import DuelingPolicy


def access(pool: BlockPool, policy: DuelingPolicy, k: Key) -> None:
    """Hit `k` if it is cached, else store it."""
    if pool.cached_block(k) is None:
        store(pool, policy, k)
    else:
        hit(pool, k)


def test_duel_with_max_frequency_one_never_leaves_lru() -> None:
    """F = 1 makes the LFU-DA shadow an LRU one: the hot-keys workload on which the
    default F = 2 switches (test_policies) gives both shadows the same hits."""
    policy = DuelingPolicy(9, max_frequency=1)
    pool = BlockPool(9, free_queue=policy)
    for r in range(40):  # 4 hot keys, then 5 fresh ones
        for k in [key(i) for i in range(4)] + [key(100 + 5 * r + i) for i in range(5)]:
            access(pool, policy, k)
    assert policy._shadow_lru.hits == policy._shadow_lfu.hits
    assert not policy.lfu_order
    policy.check_invariants()


def test_duel_lfu_order_uses_its_max_frequency() -> None:
    """In LFU-DA order with F = 1 (plain LRU) a block hit once more goes after a block
    stored after it; with F = 2 it would outlive it."""
    policy = DuelingPolicy(9, max_frequency=1)
    pool = BlockPool(9, free_queue=policy)
    policy.lfu_order = True
    blocks = [store(pool, policy, key(i)) for i in range(4)]
    hit(pool, key(0))
    later = store(pool, policy, key(4))
    cached = [b for b in pool.iter_free_after(None) if pool.key(b) is not None]
    assert cached == [*blocks[1:], blocks[0], later]
    policy.check_invariants()


def test_duel_samples_one_key_in_three_at_three_times_4096_blocks() -> None:
    """12,288 usable blocks: one key in 3 reaches the shadows (chosen by key hash), not
    two in 3."""
    policy = DuelingPolicy(3 * 4096 + 1)
    pool = BlockPool(3 * 4096 + 1, free_queue=policy)
    for i in range(300):
        store(pool, policy, key(i))
    assert 70 < policy._sampled < 130


def test_duel_keeps_its_order_on_a_tie_even_with_z_zero() -> None:
    """z = 0: any lead switches, but a tie is no lead; the LFU-DA order stays."""
    policy = DuelingPolicy(9, z=0)  # decisions every 8 accesses
    pool = BlockPool(9, free_queue=policy)
    policy.lfu_order = True
    policy._shadow_lru.hits, policy._shadow_lfu.hits = 5.0, 5.0
    for i in range(8):  # fresh keys: no shadow hits, one decision on a tie
        store(pool, policy, key(i))
    assert policy.lfu_order
    policy.check_invariants()


def test_duel_in_lfu_order_ages_when_it_evicts_any_cached_block() -> None:
    """In LFU-DA order an evicted block raises `L` even when it is not the next victim
    (here to 1, the lowest priority still queued): a block stored next gets priority
    2 and goes after the older block of priority 2."""
    policy = DuelingPolicy(9)
    pool = BlockPool(9, free_queue=policy)
    policy.lfu_order = True
    low = store(pool, policy, key(0))  # priority 1
    high = store(pool, policy, key(1))
    hit(pool, key(1))  # priority 2
    evicted = store(pool, policy, key(2))
    hit(pool, key(2))  # priority 2
    pool.evict_keys(evicted)
    fresh = store(pool, policy, key(3))
    cached = [b for b in pool.iter_free_after(None) if pool.key(b) is not None]
    assert cached == [low, high, fresh]
    policy.check_invariants()


def test_duel_in_lru_order_refuses_a_cursor_that_is_not_queued() -> None:
    policy = DuelingPolicy(9)
    pool = BlockPool(9, free_queue=policy)
    store(pool, policy, key(0))
    (in_use,) = pool.allocate(1)
    with pytest.raises(KeyError, match=f"block {in_use} is not queued"):
        list(policy.iter_after(in_use))


def test_duel_keeps_its_order_across_a_reset() -> None:
    """A reset keeps the shadows, and with them the order they chose."""
    policy = DuelingPolicy(9)
    pool = BlockPool(9, free_queue=policy)
    for r in range(40):  # 4 hot keys, then 5 fresh ones: LFU-DA wins (as in test_policies)
        for k in [key(i) for i in range(4)] + [key(100 + 5 * r + i) for i in range(5)]:
            access(pool, policy, k)
    assert policy.lfu_order
    assert pool.reset()
    assert policy.lfu_order
    policy.check_invariants()


def test_duel_check_refuses_a_cached_block_missing_from_the_lru_order() -> None:
    policy = DuelingPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    block_id = store(pool, policy, key(0))
    policy.check_invariants()
    policy._lru.unlink(block_id)  # still queued in the LFU-DA order
    with pytest.raises(AssertionError, match="orders hold different blocks"):
        policy.check_invariants()
