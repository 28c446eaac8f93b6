"""`BlockPool.evict_keys` and `BlockPool.pin`: a move to the next tier is an eviction, and
the copy that reads the block is no hit (SPEC §4; the cascade's write-back, SPEC §7).

The write-back cascade copies the CPU tier's next victims down to disk (pinning them
while the copy reads them), then drops them from the CPU tier. Before these two calls it
pinned with `touch` (a hit to every policy but LRU) and dropped with `discard_keys`
(no ghost, no aging), so a CPU tier with ARC, S3-FIFO or LFU-DA kept other blocks than
it would alone (docs/policies.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from policy_helpers import key, random_pool, store

from kvtier.core.block_pool import BlockPool, PoolError
from kvtier.core.policies import EVICTION_POLICIES
from kvtier.core.policies.arc import ARCPolicy
from kvtier.core.policies.dueling import DuelingPolicy
from kvtier.core.policies.lfuda import LFUDAPolicy


def victims(pool: BlockPool) -> list[int]:
    return list(pool.iter_free_after(None))


def aging(policy: object) -> float | None:
    """The policy's adaptive state that victims change: ARC's `p`, LFU-DA's `L`."""
    if isinstance(policy, ARCPolicy):
        return policy.target_t1
    if isinstance(policy, LFUDAPolicy):
        return policy.level
    if isinstance(policy, DuelingPolicy):
        return aging(policy._lfu)  # its LFU-DA order ages too
    return None


def evict_by_pin(pool: BlockPool, block_ids: list[int]) -> None:
    """The offload cascade's write-back: pin the victims, copy them, evict them."""
    pool.pin(block_ids)
    for block_id in block_ids:
        pool.release_evicted(block_id)


def evict_queued(pool: BlockPool, block_ids: list[int]) -> None:
    """The replay cascade's write-back: evict each queued victim."""
    for block_id in block_ids:
        pool.evict_keys(block_id)


@pytest.mark.parametrize("evict", [evict_queued, evict_by_pin])
@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("seed", range(40))
def test_evicting_the_next_victims_then_allocating_equals_allocating(
    evict: Callable[[BlockPool, list[int]], None], name: str, seed: int
) -> None:
    """Twin pools: one evicts its next 1-3 victims (`evict_keys`, or `pin` then
    `release_evicted`) before allocating as many blocks, the other just allocates. Both
    take the same blocks, age alike, and keys stored again later (some of them evicted
    ones: ARC's and S3-FIFO's ghosts) land alike."""
    rng = random.Random(seed)
    made = [random_pool(name, seed), random_pool(name, seed)]
    twins = [pool for pool, _ in made]
    policies = [policy for _, policy in made]
    for _ in range(30):
        first, second = twins
        num = min(rng.choice([1, 1, 2, 3]), first.num_free())
        if not num:
            break
        chosen = victims(first)[:num]
        evict(first, [b for b in chosen if first.key(b) is not None])
        assert all(first.key(b) is None for b in chosen)
        taken = [sorted(pool.allocate(num)) for pool in twins]
        assert taken[0] == taken[1] == sorted(chosen)
        assert aging(policies[0]) == aging(policies[1])
        for block_id in taken[0]:
            k = key(rng.randrange(3 * first.num_blocks))  # often one evicted before
            for pool, policy in zip(twins, policies, strict=True):
                if pool.cached_block(k) is None:
                    pool.insert_key(k, block_id, 16)
                    policy.note_key(block_id, k)
        for pool in twins:
            pool.free(taken[0])
            pool.check_invariants()
        assert victims(first) == victims(second)
        assert aging(policies[0]) == aging(policies[1])


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("seed", range(40))
def test_a_pin_then_free_leaves_the_order_as_it_was(name: str, seed: int) -> None:
    """`pin` + `free` of a free block counts no hit: the block rejoins its own list at
    its most recent end, as if it had been freed just now, in LRU and every policy's list."""
    pool, _ = random_pool(name, seed)
    order = victims(pool)
    cached = [b for b in order if pool.key(b) is not None]
    if not cached:
        return
    block_id = random.Random(seed).choice(cached)
    pool.pin([block_id])
    assert block_id not in victims(pool)
    assert pool.ref_count(block_id) == 1
    pool.free([block_id])
    pool.check_invariants()
    after = victims(pool)
    assert sorted(after) == sorted(order)
    if name != "s3fifo":  # its listing splits S at a count, which the block's move shifts
        rest = [b for b in order if b != block_id]
        assert [b for b in after if b != block_id] == rest  # nobody else moved


def test_arc_counts_a_pin_as_no_hit_and_an_eviction_as_a_ghost() -> None:
    """ARC: a pinned T1 block stays in T1 (a touched one moves to T2), and a key evicted
    with `evict_keys` is a B1 ghost: stored again, it goes to T2 and raises `p`."""
    policy = ARCPolicy(4)
    pool = BlockPool(4, free_queue=policy)
    a, b, c = (store(pool, policy, key(i)) for i in range(3))
    pool.pin([a])
    pool.free([a])
    pool.touch([b])
    pool.free([b])
    assert victims(pool) == [c, a, b]  # T1 (c, then a freed again), then T2 (b)
    pool.evict_keys(c)
    assert pool.key(c) is None
    assert victims(pool) == [c, a, b]  # reusable first
    store(pool, policy, key(2))
    assert policy.target_t1 == 1.0  # found in B1: T1 was too small


def test_lfuda_ages_to_an_evicted_block_but_no_further_than_the_lowest_left() -> None:
    policy = LFUDAPolicy(4)
    pool = BlockPool(4, free_queue=policy)
    low = store(pool, policy, key(0))
    high = store(pool, policy, key(1))
    pool.touch([high])  # one more access: priority 2
    pool.free([high])
    pool.evict_keys(high)  # not the victim: L rises only to what is left (priority 1)
    assert policy.level == 1
    pool.check_invariants()
    pool.evict_keys(low)
    assert policy.level == 1
    pool.check_invariants()


def test_evict_keys_refuses_a_block_in_use_and_ignores_an_unhashed_one() -> None:
    pool = BlockPool(4)
    (block_id,) = pool.allocate(1)
    pool.insert_key(key(0), block_id, 16)
    with pytest.raises(PoolError, match=f"block {block_id} is in use"):
        pool.evict_keys(block_id)
    assert pool.cached_block(key(0)) == block_id
    pool.free([block_id])
    pool.evict_keys(block_id)
    pool.evict_keys(block_id)  # no keys left: nothing to do
    assert pool.cached_block(key(0)) is None
    pool.check_invariants()
    with pytest.raises(PoolError):
        pool.evict_keys(9)
    with pytest.raises(PoolError):
        pool.pin([9])
