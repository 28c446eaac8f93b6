"""What ARC keeps and what it forgets: a block whose keys went starts over in T1, a reset
keeps the target `p` its ghosts taught it, the check bounds the ghost directory at 2c;
and every policy refuses a victim from an empty queue as the free queue does. An s36
mutation run on `core/policies/arc.py` (54 mutants) found each untested: a14, a53, a52
and a30 passed every other test, and each fails one here."""

from __future__ import annotations

import pytest
from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import EVICTION_POLICIES, ARCPolicy


def test_arc_a_block_whose_keys_were_dropped_in_use_starts_in_t1_when_stored_again() -> None:
    """A block hit while pinned is bound for T2; its keys dropped (a failed load), it
    comes back unhashed and, stored again under a key in no ghost list, is a first
    sighting: T1's, evicted before the T2 block that was really hit."""
    policy = ARCPolicy(5)  # 4 usable blocks, p = 0: T1 goes first
    pool = BlockPool(5, free_queue=policy)
    main = store(pool, policy, key(5))
    hit(pool, key(5))  # main: T2
    block_id = store(pool, policy, key(0))
    pool.touch([block_id])  # a hit: bound for T2
    pool.discard_keys(block_id)
    pool.free([block_id])  # unhashed: reused first
    policy.check_invariants()
    assert store(pool, policy, key(0)) == block_id
    policy.check_invariants()
    order = [b for b in pool.iter_free_after(None) if pool.key(b) is not None]
    assert order == [block_id, main], "the new store is T1's, the next victim"


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_every_policy_refuses_a_victim_from_an_empty_queue_by_name(name: str) -> None:
    """Every block in use: `pop_victim` raises the free queue's own IndexError, not one
    from inside the policy's lists (arc a30 popped its empty T1)."""
    policy = EVICTION_POLICIES[name](6)
    pool = BlockPool(6, free_queue=policy)
    store(pool, policy, key(0))  # cached, then evicted by the allocation
    pool.allocate(5)
    with pytest.raises(IndexError, match=r"^free queue is empty$"):
        policy.pop_victim()
    policy.check_invariants()


def test_arc_check_catches_a_ghost_directory_past_twice_the_cache() -> None:
    """ARC remembers at most 2c keys, cached and ghosts together bounded by the trims
    (arc a52: a check without that bound passed every test)."""
    policy = ARCPolicy(5)  # c = 4
    pool = BlockPool(5, free_queue=policy)
    store(pool, policy, key(0))
    for i in range(1, 9):
        policy._b1[key(i)] = None  # 8 ghosts: 2c, the most allowed
    policy.check_invariants()
    policy._b2[key(9)] = None
    with pytest.raises(AssertionError, match="ghost directory too large"):
        policy.check_invariants()


def test_arc_keeps_its_target_across_a_reset() -> None:
    """A reset drops every cached block but keeps what ARC learnt from the keys it saw:
    its ghosts (test_policies_reset.py) and the target size of T1 they moved (arc a53
    set it back to 0 and passed every test)."""
    policy = ARCPolicy(5)  # c = 4
    pool = BlockPool(5, free_queue=policy)
    for i in range(6):  # keys 0 and 1 evicted from T1: B1's
        store(pool, policy, key(i))
    store(pool, policy, key(0))  # a B1 ghost hit: p grows
    learnt = policy.target_t1
    assert learnt > 0
    assert pool.reset()
    policy.check_invariants()
    assert policy.target_t1 == learnt
