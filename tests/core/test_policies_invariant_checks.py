"""Corruptions each policy's `check_invariants` must refuse, one per check a mutation run
found untested (each test fails when its check is dropped): an S3-FIFO frequency bit
other than 0 or 1 and a ghost FIFO past its bound, an LFU-DA priority above L + F or
filed in another level's list, and duel's sample counter and shadow pools."""

from __future__ import annotations

import pytest
from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import DuelingPolicy, LFUDAPolicy, S3FIFOPolicy


def test_s3fifo_check_refuses_a_frequency_bit_other_than_0_or_1() -> None:
    """M's second chance is one bit: a count of 2 would give a block two rounds."""
    policy = S3FIFOPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    block_id = store(pool, policy, key(0))
    hit(pool, key(0))  # to M
    policy.check_invariants()
    policy._freq[block_id] = 2
    with pytest.raises(AssertionError, match="frequency bit out of range"):
        policy.check_invariants()


def test_s3fifo_check_refuses_a_ghost_fifo_past_twice_its_capacity() -> None:
    """The ghost holds at most 2 x M's size between stores (`_remember`'s bound)."""
    policy = S3FIFOPolicy(11)  # the ghost's capacity is 9
    for i in range(18):
        policy._ghost[key(i)] = None
    policy.check_invariants()
    policy._ghost[key(18)] = None
    with pytest.raises(AssertionError, match="ghost FIFO too large"):
        policy.check_invariants()


def _lfuda_with_one_block() -> tuple[LFUDAPolicy, int]:
    """LFU-DA (F = 2, L = 0) with one stored block, priority 0 + 1 = 1, in list 1."""
    policy = LFUDAPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    block_id = store(pool, policy, key(0))
    assert policy._priority[block_id] == 1
    policy.check_invariants()
    return policy, block_id


def test_lfuda_check_refuses_a_priority_above_l_plus_f() -> None:
    """After one eviction (L = 1) the first stored block still has priority 1, in list 1.
    Priority 4 = L + F + 1 shares that list (4 mod 3 = 1), so only the range check,
    [L, L + F] = [1, 3], can tell it is wrong."""
    policy = LFUDAPolicy(3)  # 2 usable blocks
    pool = BlockPool(3, free_queue=policy)
    first = store(pool, policy, key(0))
    store(pool, policy, key(1))
    store(pool, policy, key(2))  # evicts key 0's block (priority 1): L = 1
    assert policy.level == 1
    (block_id,) = (b for b in (1, 2) if b != first and policy._priority[b] == 1)
    policy.check_invariants()
    policy._priority[block_id] = 4
    with pytest.raises(AssertionError, match=r"priority 4 outside \[1, 3\]"):
        policy.check_invariants()


def test_lfuda_check_refuses_a_block_filed_under_another_priority() -> None:
    """Priority 2 is in range, but the block sits in list 1: `pop_victim` would take it
    as a priority-1 block."""
    policy, block_id = _lfuda_with_one_block()
    policy._priority[block_id] = 2
    with pytest.raises(AssertionError, match="misfiled"):
        policy.check_invariants()


def test_duel_check_refuses_a_sample_counter_at_the_window() -> None:
    """The counter restarts at 0 when it reaches the window (a decision is taken)."""
    policy = DuelingPolicy(5)
    policy._sampled = policy._window
    with pytest.raises(AssertionError, match="sample counter out of range"):
        policy.check_invariants()


@pytest.mark.parametrize("shadow", ["_shadow_lru", "_shadow_lfu"])
def test_duel_check_looks_into_both_shadow_pools(shadow: str) -> None:
    """A shadow pool whose free block has a reference (its queue and refcounts disagree)."""
    policy = DuelingPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    store(pool, policy, key(0))  # each shadow stores key 0 and frees its block
    policy.check_invariants()
    shadow_pool = getattr(policy, shadow)._pool
    (block_id,) = (b for b in range(1, shadow_pool.num_blocks) if shadow_pool._keys[b])
    shadow_pool._refs[block_id] = 1
    with pytest.raises(AssertionError):
        policy.check_invariants()
