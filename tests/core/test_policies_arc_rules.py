"""ARC's adaptation of `p` on a B2 ghost hit and its directory trim when B1 and T1 hold
more than c keys, each on a short hand-traced sequence (a mutation run found both rules
untested: each test fails when its rule is changed)."""

from __future__ import annotations

import pytest
from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import ARCPolicy


def _replay(pool: BlockPool, policy: ARCPolicy, keys: list[int]) -> None:
    """Hit each key that is cached, store the others."""
    for i in keys:
        if pool.cached_block(key(i)) is None:
            store(pool, policy, key(i))
        else:
            hit(pool, key(i))


def _after_scan_and_two_b1_hits() -> tuple[BlockPool, ARCPolicy]:
    """ARC over 4 usable blocks (c = 4), traced store by store:

    - keys 0..6 (a scan): T1 = [3, 4, 5, 6], B1 = [0, 1, 2];
    - key 0 (B1 hit; T1 = 4 > p = 0 gives key 3 to B1): p = 0 + max(0 / 4, 1) = 1, T2 = [0];
    - key 7 (T1 = 3 > 1 gives key 4): T1 = [5, 6, 7], B1 = [1, 2, 3, 4];
    - key 1 (B1 hit; key 5 goes first): p = 2, T2 = [0, 1], T1 = [6, 7], B1 = [2, 3, 4, 5];
    - key 8: T1 = 2 is not above p = 2, so T2's oldest, key 0, goes to B2. The directory
      then holds 5 keys; B1 and T1 together hold 4 + 2 > c, so B1's oldest (key 2) is
      forgotten, not key 0 of B2.
    """
    policy = ARCPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    _replay(pool, policy, [0, 1, 2, 3, 4, 5, 6, 0, 7, 1, 8])
    policy.check_invariants()
    return pool, policy


def test_arc_trims_b1_while_b1_and_t1_together_hold_more_than_c_keys() -> None:
    """The trim counts T1's free blocks with B1 (|B1| + |T1| = 6 > c = 4 while |B1| = 4 is
    not above c): it forgets B1's oldest key and keeps the key just evicted from T2."""
    _, policy = _after_scan_and_two_b1_hits()
    assert list(policy._b1) == [key(3), key(4), key(5)]
    assert list(policy._b2) == [key(0)]
    assert policy.target_t1 == pytest.approx(2.0)


def test_arc_a_b2_ghost_hit_shrinks_p_by_the_ratio_of_b1_to_b2() -> None:
    """Storing key 0 again evicts key 6 from T1 (3 > p = 2) into B1 first, so B1 holds 4
    keys and B2 one: `p` shrinks by max(4 / 1, 1) = 4, clamped at 0 (a step of 1 leaves 1);
    the block joins T2."""
    pool, policy = _after_scan_and_two_b1_hits()
    block_id = store(pool, policy, key(0))
    assert list(policy._b1) == [key(3), key(4), key(5), key(6)]
    assert not policy._b2
    assert policy.target_t1 == 0.0
    assert policy._lists.where(block_id) == 2  # T2
    policy.check_invariants()


def test_arc_check_catches_a_key_in_both_ghost_lists() -> None:
    """A key remembered in B1 and B2 at once would move `p` twice when it comes back."""
    _, policy = _after_scan_and_two_b1_hits()
    policy._b1[key(0)] = None  # key 0 is B2's
    with pytest.raises(AssertionError, match="in both ghost lists"):
        policy.check_invariants()
