"""Tests for kvtier.core.longest_hit (SPEC §5): hybrid layouts and fine-grained hits.

Several group kinds must agree on one hit length; with HASH_BLOCK granularity the hit may
end inside a full-attention block. Block ids are `bid(group_id, hash_index)` (see
`longest_hit_helpers`).
"""

from __future__ import annotations

import pytest
from longest_hit_helpers import (
    FINE,
    FULL,
    SLIDING,
    STATE,
    N,
    bid,
    cache,
    cache_blocks,
    group,
    hit,
    layout,
    make_hashes,
)

from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.core.longest_hit import LongestHit

# --- hybrid -------------------------------------------------------------------------


def test_full_and_sliding_agree() -> None:
    """Full caps at its prefix; sliding then moves the end to where its window is cached."""
    lay = layout(group(FULL), group(SLIDING, 16, 33))
    hashes, index = make_hashes(10), {}
    cache_blocks(index, hashes, lay, 0, range(6))
    cache_blocks(index, hashes, lay, 1, [3, 4, 8, 9])
    assert hit(lay, hashes, index) == LongestHit(
        80, (tuple(bid(0, i) for i in range(5)), (N, N, N, bid(1, 3), bid(1, 4)))
    )


def test_full_and_state_agree() -> None:
    """The hit ends at the last cached state inside the full-attention prefix."""
    lay = layout(group(FULL), group(STATE))
    hashes, index = make_hashes(10), {}
    cache_blocks(index, hashes, lay, 0, range(7))
    cache_blocks(index, hashes, lay, 1, [2, 4, 8])
    assert hit(lay, hashes, index) == LongestHit(
        80, (tuple(bid(0, i) for i in range(5)), (N,) * 4 + (bid(1, 4),))
    )


def test_hybrid_iterates_to_a_fixed_point() -> None:
    """Sliding and state shrink the candidate in turn over several passes (10 -> 7 -> 5 -> 4 -> 2).

    sliding (2 window blocks) accepts ends {1, 2, 3, 4, 7}; state accepts {2, 5, 8}.
    """
    lay = layout(group(FULL), group(SLIDING, 16, 33), group(STATE))
    hashes, index = make_hashes(10), {}
    cache_blocks(index, hashes, lay, 0, range(10))
    cache_blocks(index, hashes, lay, 1, [0, 1, 2, 3, 5, 6])
    cache_blocks(index, hashes, lay, 2, [1, 4, 7])
    assert hit(lay, hashes, index) == LongestHit(
        32, ((bid(0, 0), bid(0, 1)), (bid(1, 0), bid(1, 1)), (N, bid(2, 1)))
    )


def test_hybrid_full_rechecked_after_sliding() -> None:
    """Group order does not matter: sliding listed first, then full shrinks it further."""
    lay = layout(group(SLIDING, 16, 17), group(FULL))  # 1 window block
    hashes, index = make_hashes(8), {}
    cache_blocks(index, hashes, lay, 0, [2, 7])
    cache_blocks(index, hashes, lay, 1, range(5))
    assert hit(lay, hashes, index) == LongestHit(
        48, ((N, N, bid(0, 2)), (bid(1, 0), bid(1, 1), bid(1, 2)))
    )


def test_hybrid_with_different_block_sizes() -> None:
    """Full 16 + state 32: scheduler block 32, state block j under hash index 2j+1."""
    lay = layout(group(FULL, 16), group(STATE, 32))
    hashes, index = make_hashes(8), {}
    cache_blocks(index, hashes, lay, 0, range(5))  # 80 tokens -> 64 after rounding
    cache_blocks(index, hashes, lay, 1, [1, 2])  # hash indices 3 and 5
    assert hit(lay, hashes, index) == LongestHit(
        64, (tuple(bid(0, i) for i in range(4)), (N, bid(1, 3)))
    )


# --- fine-grained hits ---------------------------------------------------------------


def fine_layout(second: GroupKind = STATE, full_block_size: int = 32) -> KVLayout:
    window = 17 if second is SLIDING else None  # 1 window block
    return layout(group(FULL, full_block_size), group(second, 16, window))


@pytest.mark.parametrize("second", [STATE, SLIDING])
def test_fine_grained_hit_ends_inside_a_block(second: GroupKind) -> None:
    """A partial tail under hash 2*2+0 extends the 64-token full prefix to 80 tokens."""
    lay, hashes, index = fine_layout(second), make_hashes(8), {}
    cache(index, hashes, 0, [1, 3, 4])  # whole blocks 0, 1 + partial tail of block 2
    cache(index, hashes, 1, [1, 4])
    result = hit(lay, hashes, index, granularity=FINE)
    assert result.num_tokens == 80
    assert result.block_ids[0] == (bid(0, 1), bid(0, 3), bid(0, 4))
    assert result.block_ids[1] == (N,) * 4 + (bid(1, 4),)
    # at scheduler-block granularity the tail is ignored and the second group decides
    assert hit(lay, hashes, index).num_tokens == 32


def test_fine_grained_hit_inside_a_whole_block_uses_the_whole_block() -> None:
    """A state at 48 tokens ends inside whole block 1, which serves the hit."""
    lay, hashes, index = fine_layout(), make_hashes(8), {}
    cache(index, hashes, 0, [1, 3, 4])
    cache(index, hashes, 1, [2])
    result = hit(lay, hashes, index, granularity=FINE)
    assert result == LongestHit(48, ((bid(0, 1), bid(0, 3)), (N, N, bid(1, 2))))


def test_fine_grained_takes_the_longest_partial_tail() -> None:
    """Full block 64 over hash block 16: tails at m=0 and m=2 -> the m=2 tail wins."""
    lay, hashes, index = fine_layout(full_block_size=64), make_hashes(8), {}
    cache(index, hashes, 0, [3, 4, 6])  # whole block 0; tails of block 1 at 80, 112
    cache(index, hashes, 1, range(8))
    result = hit(lay, hashes, index, granularity=FINE)
    assert result.num_tokens == 112
    assert result.block_ids[0] == (bid(0, 3), bid(0, 6))


def test_fine_grained_rounds_cap_to_hash_block() -> None:
    """With fine-grained hits the cap is rounded down to the hash block, not the scheduler's."""
    lay, hashes, index = fine_layout(), make_hashes(8), {}
    cache(index, hashes, 0, range(8))
    cache(index, hashes, 1, range(8))
    assert hit(lay, hashes, index, 70, FINE).num_tokens == 64
    assert hit(lay, hashes, index, 90, FINE).num_tokens == 80
    assert hit(lay, hashes, index, 90).num_tokens == 64


@pytest.mark.parametrize(
    "lay",
    [
        layout(group(FULL, 16), group(STATE, 16)),
        layout(group(FULL, 32), group(STATE, 32), hash_block_size=16),
        layout(group(FULL, 16), group(SLIDING, 32, 64)),
    ],
)
def test_fine_grained_refused_without_layout_support(lay: KVLayout) -> None:
    """HASH_BLOCK granularity raises ValueError when the layout cannot support it."""
    with pytest.raises(ValueError, match="fine-grained"):
        hit(lay, make_hashes(4), {}, granularity=FINE)
