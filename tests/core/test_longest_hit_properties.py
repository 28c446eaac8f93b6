"""Tests for kvtier.core.longest_hit (SPEC §5): properties against a brute-force reference.

Random layouts, cached sets and caps; the hit must be the largest length every group
accepts, with the block ids each group's rule needs. Block ids are
`bid(group_id, hash_index)` (see `longest_hit_helpers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from longest_hit_helpers import (
    COARSE,
    FINE,
    FULL,
    SCRATCH,
    SLIDING,
    STATE,
    Index,
    N,
    bid,
    cache,
    group,
    hit,
    layout,
    make_hashes,
)

from example_counts import scaled_examples
from kvtier.core.keys import BlockHash
from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import LongestHit


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
@settings(max_examples=scaled_examples(300), deadline=None)
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


# A hybrid layout, its number of hash blocks, a cap, whether fine-grained hits are wanted
# (see `hybrid_case`).
hybrid_cases = given(
    lay=hybrid_layouts(),
    num_hashes=st.integers(0, 16),
    cap=st.integers(0, 300),
    want_fine=st.booleans(),
    data=st.data(),
)


def hybrid_case(
    lay: KVLayout, num_hashes: int, want_fine: bool, data: st.DataObject
) -> tuple[bool, dict[int, set[int]], list[BlockHash], Index]:
    """Return whether the case is fine-grained (wanted and supported), its cached hash
    indexes per group (drawn from `data`), its hashes and its index."""
    fine = want_fine and lay.supports_fine_grained_hits
    cached = data.draw(cached_sets(len(lay.groups), num_hashes))
    hashes = make_hashes(num_hashes)
    return fine, cached, hashes, index_of(lay, hashes, cached)


@hybrid_cases
@settings(max_examples=scaled_examples(400), deadline=None)
def test_hybrid_hit_is_the_largest_length_every_group_accepts(
    lay: KVLayout, num_hashes: int, cap: int, want_fine: bool, data: st.DataObject
) -> None:
    """Hybrid: every group accepts the hit and no larger multiple of the unit <= cap does."""
    fine, cached, hashes, index = hybrid_case(lay, num_hashes, want_fine, data)
    result = hit(lay, hashes, index, cap, FINE if fine else COARSE)
    unit = lay.hash_block_size if fine else lay.scheduler_block_size
    limit = min(cap, num_hashes * lay.hash_block_size)
    assert result.num_tokens % unit == 0
    assert 0 <= result.num_tokens <= limit
    assert reference_accepts(lay, cached, result.num_tokens, fine)
    for t in range(result.num_tokens + unit, limit + 1, unit):
        assert not reference_accepts(lay, cached, t, fine), t
    check_block_ids(lay, cached, result)
