"""`iter_free_after` lists free blocks in the order `allocate` takes them (SPEC §4).

The cascade's write-back demotes the next `reserve` victims it lists (offload/cascade.py),
so a listing that is not the eviction order demotes blocks the policy keeps and lets the
real victims go. Regression: `arc` listed T1 before T2 whatever its target `p`, and
`s3fifo` listed S before M and M's second-chance blocks in place.
"""

from __future__ import annotations

import pytest
from policy_helpers import key, random_pool

from kvtier.core.block_pool import BlockPool
from kvtier.core.policies import EVICTION_POLICIES


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("seed", range(150))
def test_the_listing_is_the_eviction_order(name: str, seed: int) -> None:
    pool, _ = random_pool(name, seed)
    listed = list(pool.iter_free_after(None))
    taken = [pool.allocate(1)[0] for _ in range(pool.num_free())]
    assert listed == taken
    pool.check_invariants()


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_the_listing_resumes_after_a_cursor(name: str) -> None:
    pool, _ = random_pool(name, seed=7)
    listed = list(pool.iter_free_after(None))
    for i, cursor in enumerate(listed):
        assert list(pool.iter_free_after(cursor)) == listed[i + 1 :]


def _arc_pool(target: float) -> BlockPool:
    """ARC over 13 blocks: 10 in T1, 3 in T2 (hit once), its target `p` set to `target`."""
    policy = EVICTION_POLICIES["arc"](14)
    pool = BlockPool(14, free_queue=policy)
    blocks = pool.allocate(13)
    for i, block_id in enumerate(blocks):
        pool.insert_key(key(i), block_id, 16)
        policy.note_key(block_id, key(i))
    pool.free(blocks)
    pool.touch(blocks[10:])  # hits: to T2 when freed
    pool.free(blocks[10:])
    policy.target_t1 = target  # type: ignore[attr-defined]
    return pool


@pytest.mark.parametrize("target", [0.0, 0.9999999999999998, 1.5, 1.9999999999999998, 2.0])
def test_arc_lists_exactly_when_its_target_is_just_below_a_whole_number(target: float) -> None:
    """Ghost hits move `p` by fractions (1 + 4/3 - 4/3 = 1.9999999999999998): the listing
    compares as `pop_victim` does, where a float estimate (10 - p rounds to 8.0) was one
    block short."""
    listed = list(_arc_pool(target).iter_free_after(None))
    pool = _arc_pool(target)
    assert listed == [pool.allocate(1)[0] for _ in range(pool.num_free())]
