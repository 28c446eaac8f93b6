"""What a review of the eviction policies found: corruptions `check_invariants` let pass,
a block id `BlockPool.pin` accepts that `duel` refused, and numpy ids kept in the index.

Each corruption is one a policy bug would leave behind: a cached block reused before an
unhashed one (SPEC §4), a queued block bound for the other list when it is freed again
after a pin, a cached block without the key its ghost or frequency is kept under, a block
on probation with S3-FIFO's frequency bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from policy_helpers import key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import (
    EVICTION_POLICIES,
    ARCPolicy,
    DuelingPolicy,
    EvictionPolicy,
    LFUDAPolicy,
    S3FIFOPolicy,
)


def _pool(name: str) -> tuple[BlockPool, EvictionPolicy, list[int]]:
    """A pool of 8 blocks: two unhashed free blocks, five cached ones (the last two hit)."""
    policy = EVICTION_POLICIES[name](8)
    pool = BlockPool(8, free_queue=policy)
    blocks = [store(pool, policy, key(i)) for i in range(5)]
    pool.touch(blocks[3:])  # hits: ARC's T2, S3-FIFO's main FIFO
    pool.free(blocks[3:])
    pool.check_invariants()
    return pool, policy, blocks


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_check_catches_a_cached_block_queued_to_be_reused_first(name: str) -> None:
    """Queued among the unhashed blocks, a cached block is reused before them: a lost hit."""
    pool, policy, blocks = _pool(name)
    policy.remove(blocks[0])
    policy.push_reusable(blocks[0])
    with pytest.raises(AssertionError, match="unhashed free block is queued behind"):
        pool.check_invariants()


def test_arc_check_catches_a_queued_block_bound_for_the_other_list() -> None:
    pool, policy, blocks = _pool("arc")
    assert isinstance(policy, ARCPolicy)
    policy._dest[blocks[0]] = 2  # in T1, bound for T2 once pinned and freed again
    with pytest.raises(AssertionError, match="bound for"):
        pool.check_invariants()


def _drop_first_key(policy: EvictionPolicy, block_id: int) -> None:
    lfu = policy._lfu if isinstance(policy, DuelingPolicy) else policy
    assert isinstance(lfu, ARCPolicy | S3FIFOPolicy | LFUDAPolicy)
    lfu._keys[block_id] = None


@pytest.mark.parametrize("name", ["arc", "s3fifo", "lfuda", "duel"])
def test_check_catches_a_queued_cached_block_the_policy_knows_no_key_of(name: str) -> None:
    """Evicted, it would leave no ghost (ARC, S3-FIFO); hit, no count (LFU-DA)."""
    pool, policy, blocks = _pool(name)
    _drop_first_key(policy, blocks[4])
    with pytest.raises(AssertionError, match="has no key"):
        pool.check_invariants()


def _s3fifo_dest_to_small(policy: S3FIFOPolicy, blocks: list[int]) -> None:
    policy._dest[blocks[4]] = 1  # in M, bound for S once pinned and freed again


def _s3fifo_bit_in_small(policy: S3FIFOPolicy, blocks: list[int]) -> None:
    policy._freq[blocks[0]] = 1  # only M gives a second round


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [(_s3fifo_dest_to_small, "bound for"), (_s3fifo_bit_in_small, "frequency bit")],
)
def test_s3fifo_check_catches_a_block_state_its_fifo_does_not_allow(
    corrupt: Callable[[S3FIFOPolicy, list[int]], None], message: str
) -> None:
    pool, policy, blocks = _pool("s3fifo")
    assert isinstance(policy, S3FIFOPolicy)
    corrupt(policy, blocks)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("lfu_order", [False, True])
def test_pin_takes_a_numpy_block_id_under_every_policy(name: str, lfu_order: bool) -> None:
    """`pin` accepts a numpy integer id (as `touch` does); `duel` stored a numpy bool in
    its bytearray of notes and raised TypeError (LRU order)."""
    pool, policy, blocks = _pool(name)
    if isinstance(policy, DuelingPolicy):
        policy.lfu_order = lfu_order
    victim = next(pool.iter_free_after(None))
    pool.pin(np.array([victim, blocks[4]], dtype=np.int64))
    assert pool.ref_count(victim) == pool.ref_count(blocks[4]) == 1
    pool.check_invariants()


@pytest.mark.parametrize("batched", [False, True])
def test_a_numpy_block_id_is_indexed_as_an_int(batched: bool) -> None:
    """`insert_key` takes a numpy id; the index then handed that numpy int out of
    `cached_block` and `lookup` (and kept it in the policy-facing dicts)."""
    pool = BlockPool(4)
    (block_id,) = pool.allocate(1)
    if batched:
        pool.insert_keys([key(1)], np.array([block_id]), [16])
    else:
        pool.insert_key(key(1), np.int64(block_id), 16)  # type: ignore[arg-type]
    found = pool.cached_block(key(1))
    assert found == block_id
    assert type(found) is int
    pool.check_invariants()
