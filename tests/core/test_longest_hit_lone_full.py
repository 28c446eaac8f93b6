"""Tests for kvtier.core.longest_hit's fast path (SPEC §5): a layout whose only cacheable
group is full attention, at scheduler-block granularity with no EAGLE proof, skips the
matchers (`_lone_full_hit`). Differential: on random layouts, caches and caps it must
return `_hybrid_hit`'s hit and look up the same keys in the same order (a token-checked
lookup counts and logs what it looks up).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from longest_hit_helpers import COARSE, FINE, FULL, SCRATCH, SLIDING, group, layout, make_hashes

from example_counts import scaled_examples
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import _hybrid_hit, _lone_full_hit, find_longest_hit


@st.composite
def lone_full_layouts(draw: st.DrawFn) -> KVLayout:
    """One full-attention group among 0-2 scratch groups, at any position."""
    hbs = draw(st.sampled_from([8, 16]))
    full = group(FULL, hbs * draw(st.sampled_from([1, 2, 4])))
    scratch = [group(SCRATCH, hbs * draw(st.sampled_from([1, 2, 3]))) for _ in range(2)]
    num_scratch = draw(st.integers(0, 2))
    groups = scratch[:num_scratch]
    groups.insert(draw(st.integers(0, num_scratch)), full)
    return layout(*groups, hash_block_size=hbs)


class RecordingIndex:
    """A `cached_block` over a dict that records every key it is asked for."""

    def __init__(self, index: dict[Key, int]) -> None:
        self.index = index
        self.asked: list[Key] = []

    def __call__(self, key: Key) -> int | None:
        self.asked.append(key)
        return self.index.get(key)


@given(
    lay=lone_full_layouts(),
    num_hashes=st.integers(0, 24),
    cap=st.integers(-5, 450),
    data=st.data(),
)
@settings(max_examples=scaled_examples(500), deadline=None)
def test_lone_full_hit_is_the_general_hit(
    lay: KVLayout, num_hashes: int, cap: int, data: st.DataObject
) -> None:
    """Same hit, same block ids, same keys looked up in the same order as `_hybrid_hit`."""
    group_id = lay.lone_full_group
    assert group_id is not None
    hashes = make_hashes(num_hashes)
    # A cached prefix, then random keys of any hash index or group (holes, stray hits).
    prefix = data.draw(st.integers(0, num_hashes))
    indices = set(range(prefix)) | data.draw(st.sets(st.integers(0, max(0, num_hashes - 1))))
    index = {
        make_key(hashes[i], g): 1 + 100 * g + i
        for i in indices
        if i < num_hashes
        for g in range(len(lay.groups))
    }
    fast, general = RecordingIndex(index), RecordingIndex(index)
    expected = _hybrid_hit(lay, hashes, cap, general, False, False)
    assert _lone_full_hit(lay, group_id, hashes, cap, fast) == expected
    assert fast.asked == general.asked
    assert find_longest_hit(lay, hashes, cap, index.get) == expected


def test_only_a_lone_full_group_takes_the_fast_path() -> None:
    """Sliding windows, two full groups or none have no `lone_full_group`; fine-grained
    hits and EAGLE proofs take the general path (their hits differ from the scan's)."""
    assert layout(group(FULL), group(SCRATCH)).lone_full_group == 0
    assert layout(group(SCRATCH), group(FULL)).lone_full_group == 1
    assert layout(group(FULL), group(FULL)).lone_full_group is None
    assert layout(group(FULL), group(SLIDING, 16, 32)).lone_full_group is None
    assert layout(group(SLIDING, 16, 32)).lone_full_group is None
    lay = layout(group(FULL, 32), hash_block_size=16)
    hashes = make_hashes(4)
    index = {make_key(h, 0): 1 + i for i, h in enumerate(hashes)}
    assert find_longest_hit(lay, hashes, 64, index.get, COARSE).num_tokens == 64
    # EAGLE: the block after the hit proves it; with fine hits the tail's hash block counts.
    assert find_longest_hit(lay, hashes, 64, index.get, COARSE, True).num_tokens == 32
    assert find_longest_hit(lay, hashes[:3], 48, index.get, FINE).num_tokens == 48
