"""Tests for kvtier.core.longest_hit (SPEC §5): the rule of each group kind on its own.

Full attention, sliding window, state and scratch groups, and the token cap. The helpers
(`longest_hit_helpers`) register block ids `bid(group_id, hash_index)`, so every expected
`block_ids` entry can be read straight off the test.
"""

from __future__ import annotations

import re

import pytest
from longest_hit_helpers import (
    FINE,
    FULL,
    NO_CAP,
    SCRATCH,
    SLIDING,
    STATE,
    Index,
    N,
    bid,
    cache,
    cache_blocks,
    group,
    hit,
    layout,
    make_hashes,
)

from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import LongestHit, find_longest_hit

# --- full attention -----------------------------------------------------------------


def test_full_attention_stops_at_first_miss() -> None:
    """Full attention scans left to right and ignores cached blocks after a miss."""
    lay, hashes, index = layout(group(FULL)), make_hashes(8), {}
    cache_blocks(index, hashes, lay, 0, [0, 1, 2, 4, 5, 6, 7])
    assert hit(lay, hashes, index) == LongestHit(48, ((bid(0, 0), bid(0, 1), bid(0, 2)),))


def test_full_attention_first_block_missing_is_no_hit() -> None:
    """A miss on block 0 gives no hit and empty block ids."""
    lay, hashes, index = layout(group(FULL)), make_hashes(4), {}
    cache_blocks(index, hashes, lay, 0, [1, 2, 3])
    assert hit(lay, hashes, index) == LongestHit(0, ((),))


def test_no_hashes_is_no_hit() -> None:
    """An empty hash list gives no hit."""
    assert hit(layout(group(FULL)), [], {}) == LongestHit(0, ((),))


def test_other_groups_keys_do_not_count() -> None:
    """A key cached for another group id is not a hit for this one."""
    lay, hashes, index = layout(group(FULL), group(FULL)), make_hashes(4), {}
    cache_blocks(index, hashes, lay, 0, range(4))
    cache_blocks(index, hashes, lay, 1, range(2))
    assert hit(lay, hashes, index).num_tokens == 32


@pytest.mark.parametrize(
    ("cap", "expected"), [(NO_CAP, 128), (128, 128), (127, 112), (50, 48), (16, 16), (15, 0)]
)
def test_max_num_tokens_caps_and_rounds_down(cap: int, expected: int) -> None:
    """The hit never exceeds max_num_tokens and is a whole number of blocks."""
    lay, hashes, index = layout(group(FULL)), make_hashes(8), {}
    cache_blocks(index, hashes, lay, 0, range(8))
    result = hit(lay, hashes, index, cap)
    assert result.num_tokens == expected
    assert result.block_ids == (tuple(bid(0, i) for i in range(expected // 16)),)


def test_zero_cap_is_no_hit() -> None:
    """max_num_tokens = 0 gives no hit."""
    lay, hashes, index = layout(group(FULL)), make_hashes(2), {}
    cache_blocks(index, hashes, lay, 0, range(2))
    assert hit(lay, hashes, index, 0) == LongestHit(0, ((),))


def test_negative_cap_is_no_hit() -> None:
    """A negative max_num_tokens gives no hit rather than a negative length."""
    lay, hashes, index = layout(group(FULL)), make_hashes(2), {}
    cache_blocks(index, hashes, lay, 0, range(2))
    assert hit(lay, hashes, index, -1) == LongestHit(0, ((),))


@pytest.mark.parametrize("cap", [32.0, True, "32", None])
def test_a_cap_that_is_not_an_int_is_named(cap: object) -> None:
    """Regression: a float cap failed deep inside with a TypeError naming nothing, and
    True capped the hit at one token."""
    lay, hashes, index = layout(group(FULL)), make_hashes(2), {}
    cache_blocks(index, hashes, lay, 0, range(2))
    with pytest.raises(TypeError, match=f"max_num_tokens must be an int, got {cap!r}"):
        hit(lay, hashes, index, cap)  # type: ignore[arg-type]


def test_hit_rounds_down_to_scheduler_block() -> None:
    """Full blocks 16 + 32: three cached 16-blocks (48 tokens) round down to 32."""
    lay, hashes, index = layout(group(FULL, 16), group(FULL, 32)), make_hashes(8), {}
    assert lay.scheduler_block_size == 32
    cache_blocks(index, hashes, lay, 0, range(3))
    cache_blocks(index, hashes, lay, 1, range(4))
    assert hit(lay, hashes, index) == LongestHit(32, ((bid(0, 0), bid(0, 1)), (bid(1, 1),)))


def test_coarse_group_block_j_uses_hash_index_j_plus_one_times_k_minus_one() -> None:
    """A 32-token block over 16-token hashes is found under hash 2j+1, not 2j."""
    lay, hashes = layout(group(FULL, 32), hash_block_size=16), make_hashes(6)
    odd: Index = {}
    cache(odd, hashes, 0, [1, 3])
    assert hit(lay, hashes, odd) == LongestHit(64, ((bid(0, 1), bid(0, 3)),))
    even: Index = {}
    cache(even, hashes, 0, [0, 2, 4])
    assert hit(lay, hashes, even).num_tokens == 0


def test_trailing_partial_block_of_hashes_is_not_a_hit() -> None:
    """Five 16-token hashes hold only two whole 32-token blocks."""
    lay, hashes, index = layout(group(FULL, 32), hash_block_size=16), make_hashes(5), {}
    cache(index, hashes, 0, range(5))
    assert hit(lay, hashes, index).num_tokens == 64


# --- sliding window -----------------------------------------------------------------


def sliding_layout(window: int = 33) -> KVLayout:
    return layout(group(SLIDING, 16, window))  # window 33 -> 2 window blocks


def test_sliding_window_needs_only_the_last_window() -> None:
    """Only the 2 blocks before the end are needed; earlier positions are null."""
    lay, hashes, index = sliding_layout(), make_hashes(10), {}
    cache_blocks(index, hashes, lay, 0, [8, 9])
    assert hit(lay, hashes, index) == LongestHit(160, ((N,) * 8 + (bid(0, 8), bid(0, 9)),))


def test_sliding_window_miss_moves_end_before_it() -> None:
    """A miss inside the window moves the end to the missing block's start."""
    lay, hashes, index = sliding_layout(), make_hashes(10), {}
    cache_blocks(index, hashes, lay, 0, [0, 1, 2, 3, 4, 5, 6, 7, 9])
    assert hit(lay, hashes, index) == LongestHit(128, ((N,) * 6 + (bid(0, 6), bid(0, 7)),))


def test_sliding_window_scans_right_to_left() -> None:
    """The longest end whose window is cached wins, even far from the right."""
    lay, hashes, index = sliding_layout(), make_hashes(10), {}
    cache_blocks(index, hashes, lay, 0, [2, 3, 5, 7, 9])
    assert hit(lay, hashes, index) == LongestHit(64, ((N, N, bid(0, 2), bid(0, 3)),))


def test_sliding_window_is_clipped_at_the_start() -> None:
    """A hit of one block needs only that block, however wide the window."""
    lay, hashes, index = sliding_layout(window=100), make_hashes(6), {}
    cache_blocks(index, hashes, lay, 0, [0, 2, 3, 4, 5])
    assert hit(lay, hashes, index) == LongestHit(16, ((bid(0, 0),),))


def test_sliding_window_respects_cap() -> None:
    """The window is checked before the capped, rounded end, not the last hash."""
    lay, hashes, index = sliding_layout(), make_hashes(10), {}
    cache_blocks(index, hashes, lay, 0, [4, 5])
    assert hit(lay, hashes, index, 100) == LongestHit(96, ((N,) * 4 + (bid(0, 4), bid(0, 5)),))


def test_a_window_of_one_token_still_needs_the_block_ending_at_the_hit() -> None:
    """A window of 1 needs no block, but a hit is a prefix seen before: with only such
    groups cached, the block ending at the hit is looked up (vLLM's manager stops at the
    first cached block), served as null. Nothing cached is no hit."""
    lay, hashes, index = sliding_layout(window=1), make_hashes(6), {}
    assert hit(lay, hashes, index) == LongestHit(0, ((),))
    cache_blocks(index, hashes, lay, 0, [1, 3])
    assert hit(lay, hashes, index) == LongestHit(64, ((N,) * 4,))
    assert hit(lay, hashes, index, 63) == LongestHit(32, ((N, N),))


def test_a_window_of_one_token_beside_full_attention_needs_no_block() -> None:
    """Beside a full-attention group (whose blocks prove the prefix) a window of 1 needs
    none of its own blocks: SPEC §5's ceil((window - 1) / block_size) = 0."""
    lay, hashes, index = layout(group(FULL), group(SLIDING, 16, 1)), make_hashes(4), {}
    cache_blocks(index, hashes, lay, 0, range(3))
    assert hit(lay, hashes, index) == LongestHit(48, (tuple(bid(0, i) for i in range(3)), (N,) * 3))


# --- state --------------------------------------------------------------------------


def test_state_takes_the_last_cached_state() -> None:
    """State scans right to left for a cached state; earlier positions are null."""
    lay, hashes, index = layout(group(STATE)), make_hashes(8), {}
    cache_blocks(index, hashes, lay, 0, [2, 5])
    assert hit(lay, hashes, index) == LongestHit(96, ((N,) * 5 + (bid(0, 5),),))


def test_state_cap_falls_back_to_an_earlier_state() -> None:
    """Capping before the last state falls back to the previous cached one."""
    lay, hashes, index = layout(group(STATE)), make_hashes(8), {}
    cache_blocks(index, hashes, lay, 0, [2, 5])
    assert hit(lay, hashes, index, 90) == LongestHit(48, ((N, N, bid(0, 2)),))


def test_state_without_cached_state_is_no_hit() -> None:
    """A state group with nothing cached gives no hit."""
    assert hit(layout(group(STATE)), make_hashes(4), {}).num_tokens == 0


# --- scratch ------------------------------------------------------------------------


def test_scratch_group_gets_empty_ids_and_never_blocks() -> None:
    """A scratch group with nothing cached does not shorten the hit and gets ()."""
    lay, hashes, index = layout(group(SCRATCH), group(FULL), group(SCRATCH)), make_hashes(4), {}
    cache_blocks(index, hashes, lay, 1, range(3))
    assert hit(lay, hashes, index) == LongestHit(48, ((), tuple(bid(1, i) for i in range(3)), ()))


def test_layout_without_cacheable_group_never_hits() -> None:
    """Nothing is ever cached for scratch groups, so a scratch-only layout cannot hit."""
    assert hit(layout(group(SCRATCH)), make_hashes(4), {}) == LongestHit(0, ((),))


def test_a_granularity_is_taken_by_value_or_refused_naming_it() -> None:
    """'hash_block' was silently a scheduler-block hit, and so was any other value."""
    lay = KVLayout((group(FULL, 4),), 2)
    hashes = make_hashes(4)
    index: Index = {}
    cache(index, hashes, 0, [0, 1, 2])
    fine = find_longest_hit(lay, hashes, NO_CAP, index.get, "hash_block")  # type: ignore[arg-type]
    assert fine.num_tokens == 6 == hit(lay, hashes, index, granularity=FINE).num_tokens
    with pytest.raises(ValueError, match="'bogus' is not a valid HitGranularity"):
        find_longest_hit(lay, hashes, NO_CAP, index.get, "bogus")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "lay",
    [
        layout(group(FULL, 16)),  # the lone full-attention fast path
        layout(group(FULL, 16), group(SLIDING, 16, 32)),  # the matchers' prefix scan
    ],
)
@pytest.mark.parametrize("bad", ["abc", bytearray(32)])
def test_a_block_hash_that_is_not_bytes_is_named(lay: KVLayout, bad: object) -> None:
    """Regression: a str hash failed with "can only concatenate str (not "bytes") to
    str" and a bytearray one with "unhashable type", naming neither it nor its index."""
    hashes: list[object] = [*make_hashes(2), bad]
    index: Index = {}
    cache(index, make_hashes(2), 0, [0, 1])
    with pytest.raises(TypeError, match=rf"block hash 2 \({re.escape(repr(bad))}\)"):
        find_longest_hit(lay, hashes, NO_CAP, index.get)  # type: ignore[arg-type]
