"""Tests for kvtier.core.longest_hit (SPEC §5).

Hashes are arbitrary distinct bytes and the cache is a dict `{key: block_id}`: the
function only needs distinct chained-hash-like values and a `cached_block` callable.
Block ids encode where they were registered — `bid(group_id, hash_index)` — so every
expected `block_ids` entry can be read straight off the test.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import BlockHash, Key, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.core.longest_hit import HitGranularity, LongestHit, find_longest_hit

FULL = GroupKind.FULL_ATTENTION
SLIDING = GroupKind.SLIDING_WINDOW
STATE = GroupKind.STATE
SCRATCH = GroupKind.SCRATCH
FINE = HitGranularity.HASH_BLOCK
COARSE = HitGranularity.SCHEDULER_BLOCK
NO_CAP = 10**9
N = NULL_BLOCK_ID

Index = dict[Key, int]


def make_hashes(n: int) -> list[BlockHash]:
    return [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n)]


def group(kind: GroupKind, block_size: int = 16, window: int | None = None) -> KVGroupSpec:
    return KVGroupSpec(kind, block_size, 64, window)


def layout(*groups: KVGroupSpec, hash_block_size: int | None = None) -> KVLayout:
    return KVLayout(tuple(groups), hash_block_size)


def bid(group_id: int, hash_index: int) -> int:
    """Return the block id the tests register for `hash_index` in `group_id` (never null)."""
    return 1 + 1000 * group_id + hash_index


def cache(index: Index, hashes: Sequence[BlockHash], group_id: int, indices: Iterable[int]) -> None:
    """Register the keys of the given hash indices in `group_id`."""
    for i in indices:
        index[make_key(hashes[i], group_id)] = bid(group_id, i)


def cache_blocks(
    index: Index, hashes: Sequence[BlockHash], lay: KVLayout, group_id: int, blocks: Iterable[int]
) -> None:
    """Register whole blocks of `group_id`: block j under hash index (j+1)*k - 1."""
    k = lay.blocks_per_hash(group_id)
    cache(index, hashes, group_id, [(j + 1) * k - 1 for j in blocks])


def hit(
    lay: KVLayout,
    hashes: Sequence[BlockHash],
    index: Index,
    max_num_tokens: int = NO_CAP,
    granularity: HitGranularity = COARSE,
) -> LongestHit:
    return find_longest_hit(lay, hashes, max_num_tokens, index.get, granularity)


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


# --- properties against a brute-force reference --------------------------------------


def reference_accepts(lay: KVLayout, cached: dict[int, set[int]], t: int, fine: bool) -> bool:
    """Return True when every cacheable group can serve a hit of exactly t tokens."""
    hbs = lay.hash_block_size
    for g in lay.cacheable_group_ids:
        spec, have = lay.groups[g], cached[g]
        bs, k = spec.block_size, spec.block_size // hbs
        whole = t // bs

        def is_whole(j: int, have: set[int] = have, k: int = k) -> bool:
            return (j + 1) * k - 1 in have

        if spec.kind is FULL:
            if not all(is_whole(j) for j in range(whole)):
                return False
            if t % bs:
                assert fine
                # block `whole` is served by its whole key or by a tail covering t
                needed = (t % bs) // hbs
                if not {whole * k + m for m in range(needed - 1, k)} & have:
                    return False
        elif spec.kind is SLIDING:
            nwb = math.ceil((spec.sliding_window - 1) / bs)  # type: ignore[operator]
            if not all(is_whole(j) for j in range(max(0, whole - nwb), whole)):
                return False
        elif t > 0 and not is_whole(whole - 1):  # state
            return False
    return True


def check_block_ids(lay: KVLayout, cached: dict[int, set[int]], result: LongestHit) -> None:
    """Assert the block ids are the ones each group's rule needs for the hit."""
    t, hbs = result.num_tokens, lay.hash_block_size
    for g, spec in enumerate(lay.groups):
        ids = result.block_ids[g]
        if t == 0 or spec.kind is SCRATCH:
            assert ids == ()
            continue
        bs, k = spec.block_size, spec.block_size // hbs
        assert len(ids) == math.ceil(t / bs)
        first_needed = 0  # positions before it must be null
        if spec.kind is SLIDING:
            first_needed = t // bs - math.ceil((spec.sliding_window - 1) / bs)  # type: ignore[operator]
        elif spec.kind is STATE:
            first_needed = len(ids) - 1
        for j, block_id in enumerate(ids):
            if j < first_needed:
                assert block_id == N
            elif (j + 1) * bs <= t:
                assert block_id == bid(g, (j + 1) * k - 1)
            else:  # a full-attention block the hit ends inside: whole block or a long tail
                first = j * k + (t % bs) // hbs - 1
                assert block_id in {bid(g, i) for i in cached[g] if first <= i < (j + 1) * k}


def index_of(lay: KVLayout, hashes: Sequence[BlockHash], cached: dict[int, set[int]]) -> Index:
    index: Index = {}
    for g in lay.cacheable_group_ids:
        cache(index, hashes, g, cached[g])
    return index


@st.composite
def cached_sets(draw: st.DrawFn, num_groups: int, num_hashes: int) -> dict[int, set[int]]:
    """Mostly-cached hash indices per group with a few holes, so hits are long enough."""
    indices = st.integers(0, max(0, num_hashes - 1))
    result = {}
    for g in range(num_groups):
        holes = draw(st.sets(indices, max_size=4)) if num_hashes else set()
        extra_holes = draw(st.booleans())
        if extra_holes:
            holes |= draw(st.sets(indices, max_size=num_hashes))
        result[g] = set(range(num_hashes)) - holes
    return result


@given(
    block_size=st.sampled_from([16, 32, 64]),
    num_hashes=st.integers(0, 20),
    cap=st.integers(0, 400),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_single_full_group_matches_brute_force(
    block_size: int, num_hashes: int, cap: int, data: st.DataObject
) -> None:
    """Single full group: the hit is the largest multiple of the block <= cap, all cached."""
    lay = layout(group(FULL, block_size), hash_block_size=16)
    cached = data.draw(cached_sets(1, num_hashes))
    hashes = make_hashes(num_hashes)
    result = hit(lay, hashes, index_of(lay, hashes, cached), cap)
    k = block_size // 16
    expected = 0
    for t in range(block_size, min(cap, num_hashes * 16) + 1, block_size):
        if all((j + 1) * k - 1 in cached[0] for j in range(t // block_size)):
            expected = t
    assert result.num_tokens == expected
    assert result.block_ids == (
        tuple(bid(0, (j + 1) * k - 1) for j in range(expected // block_size)),
    )


@st.composite
def hybrid_layouts(draw: st.DrawFn) -> KVLayout:
    """A full-attention group followed by 1-3 sliding, state, full or scratch groups."""
    groups = [group(FULL, draw(st.sampled_from([16, 32, 64])))]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from([SLIDING, SLIDING, STATE, FULL, SCRATCH]))
        bs = draw(st.sampled_from([16, 32]))
        window = draw(st.integers(1, 80)) if kind is SLIDING else None
        groups.append(group(kind, bs, window))
    return layout(*groups)


@given(
    lay=hybrid_layouts(),
    num_hashes=st.integers(0, 16),
    cap=st.integers(0, 300),
    want_fine=st.booleans(),
    data=st.data(),
)
@settings(max_examples=400, deadline=None)
def test_hybrid_hit_is_the_largest_length_every_group_accepts(
    lay: KVLayout, num_hashes: int, cap: int, want_fine: bool, data: st.DataObject
) -> None:
    """Hybrid: every group accepts the hit and no larger multiple of the unit <= cap does."""
    fine = want_fine and lay.supports_fine_grained_hits
    cached = data.draw(cached_sets(len(lay.groups), num_hashes))
    hashes = make_hashes(num_hashes)
    result = hit(lay, hashes, index_of(lay, hashes, cached), cap, FINE if fine else COARSE)
    unit = lay.hash_block_size if fine else lay.scheduler_block_size
    limit = min(cap, num_hashes * lay.hash_block_size)
    assert result.num_tokens % unit == 0
    assert 0 <= result.num_tokens <= limit
    assert reference_accepts(lay, cached, result.num_tokens, fine)
    for t in range(result.num_tokens + unit, limit + 1, unit):
        assert not reference_accepts(lay, cached, t, fine), t
    check_block_ids(lay, cached, result)
