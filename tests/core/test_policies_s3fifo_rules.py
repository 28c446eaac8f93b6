"""S3-FIFO rules a mutation run found untested (each test fails when its rule is
changed): a block stored again after its keys were dropped while in use starts in S,
a ghost key that sent a block to M is forgotten, and M's second-chance rounds are given
only when, and as far as, `pop_victim` would give them."""

from __future__ import annotations

from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import S3FIFOPolicy


def cached_order(pool: BlockPool) -> list[int]:
    """Return the free cached blocks in eviction order."""
    return [b for b in pool.iter_free_after(None) if pool.key(b) is not None]


def test_s3fifo_a_block_whose_keys_were_dropped_in_use_starts_in_s_when_stored_again() -> None:
    """A block hit in S is bound for M; its keys dropped while pinned (a failed load), it
    comes back unhashed and, stored again under the same key (no ghost), goes to S."""
    policy = S3FIFOPolicy(5)  # 4 usable blocks: S holds 1
    pool = BlockPool(5, free_queue=policy)
    main = store(pool, policy, key(5))
    hit(pool, key(5))  # hit in S: M = [main]
    block_id = store(pool, policy, key(0))
    pool.touch([block_id])  # hit in S: bound for M
    pool.discard_keys(block_id)
    pool.free([block_id])  # unhashed: reused first
    policy.check_invariants()
    assert store(pool, policy, key(0)) == block_id
    policy.check_invariants()
    assert cached_order(pool) == [block_id, main], "the new store is S's, the next victim"


def test_s3fifo_a_ghost_key_stored_again_leaves_the_ghost() -> None:
    """A key found in the ghost sends its block to M and is forgotten: evicted from M
    later and stored again, it is a one-hit wonder in S."""
    policy = S3FIFOPolicy(5)  # 4 usable blocks: S holds 1, the ghost 3
    pool = BlockPool(5, free_queue=policy)
    for i in range(5):  # keys 1..4 cached (S), key 0 evicted from S: a ghost
        store(pool, policy, key(i))
    assert list(policy._ghost) == [key(0)]
    store(pool, policy, key(0))  # a ghost: to M, and no longer a ghost
    assert key(0) not in policy._ghost
    policy.check_invariants()


def test_s3fifo_a_pin_in_s_gives_main_no_rounds() -> None:
    """While `pop_victim` takes from M (S below its share), pinning a block of S gives
    M's head blocks no second-chance round: `pop_victim` would not pass them for it.
    A block stored into M afterwards still goes before the one whose bit is set."""
    policy = S3FIFOPolicy(21)  # 20 usable blocks: S's share is 2
    pool = BlockPool(21, free_queue=policy)
    a = store(pool, policy, key(0))
    hit(pool, key(0))  # hit in S: M = [a]
    hit(pool, key(0))  # hit in M: a's frequency bit is set
    b = store(pool, policy, key(1))
    hit(pool, key(1))  # M = [a (bit), b]
    s = store(pool, policy, key(2))  # S = [s]: below its share, M gives the victims
    pool.pin([s])
    pool.free([s])
    d = store(pool, policy, key(3))
    hit(pool, key(3))  # M = [a (bit), b, d]
    policy.check_invariants()
    assert cached_order(pool) == [b, d, a, s]


def test_s3fifo_evicting_a_block_with_its_bit_set_gives_rounds_past_it() -> None:
    """Evicting a block of M with its bit set gives it and the bit-set blocks behind it
    their round (cleared, to the tail), up to a block without one, as `pop_victim`
    passing them would: a block stored into M afterwards goes after them."""
    policy = S3FIFOPolicy(5)  # 4 usable blocks: S's share is 1
    pool = BlockPool(5, free_queue=policy)
    blocks = [store(pool, policy, key(i)) for i in range(3)]
    for _ in range(2):  # hit in S: to M; hit in M: the frequency bit is set
        for i in range(2):
            hit(pool, key(i))
    hit(pool, key(2))  # M = [x (bit), y (bit), z]
    x, y, z = blocks
    pool.evict_keys(x)  # M = [z, y], both without a bit
    w = store(pool, policy, key(3))
    hit(pool, key(3))  # M = [z, y, w]
    policy.check_invariants()
    assert cached_order(pool) == [z, y, w]
