"""Tests for kvtier.core.longest_hit with an EAGLE-style drafter (`eagle_proof`).

Attention groups accept a length T only where they would also accept T + one unit (the
block after the hit cached: the token the stored draft KV saw is the request's own);
state groups are served as they are. Block ids are `bid(group_id, hash_index)` (see
`longest_hit_helpers`).
"""

from __future__ import annotations

import dataclasses
import functools

from hypothesis import settings
from hypothesis import strategies as st
from longest_hit_helpers import (
    COARSE,
    FINE,
    FULL,
    NO_CAP,
    SCRATCH,
    SLIDING,
    STATE,
    Index,
    N,
    bid,
    cache_blocks,
    group,
    hit,
    layout,
    make_hashes,
)
from test_longest_hit_properties import (
    check_block_ids,
    hybrid_case,
    hybrid_cases,
    reference_accepts,
)

from example_counts import scaled_examples
from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import LongestHit, find_longest_hit

eagle_hit = functools.partial(hit, eagle_proof=True)


def test_full_attention_hits_end_one_block_before_the_cached_prefix() -> None:
    lay, hashes, index = layout(group(FULL)), make_hashes(6), {}
    cache_blocks(index, hashes, lay, 0, range(5))  # 80 tokens cached
    assert eagle_hit(lay, hashes, index) == LongestHit(64, (tuple(bid(0, i) for i in range(4)),))
    assert eagle_hit(lay, hashes, index, 40).num_tokens == 32  # the cap, proof within reach
    # The proof block may lie past the cap (it is not loaded), not past the hashes.
    assert eagle_hit(lay, hashes, index, 79).num_tokens == 64
    assert eagle_hit(lay, hashes[:4], index).num_tokens == 48
    assert eagle_hit(lay, hashes[:1], index).num_tokens == 0


def test_a_hybrid_hit_ends_at_the_state_when_the_attention_proof_holds() -> None:
    """vLLM keeps an EAGLE engine's Mamba state one block before the prompt's last block:
    attention blocks 0-3 and the state at 48 tokens serve 48 tokens (block 3 is the
    proof). The longest hit (48, without proof) cut short by a block had no state."""
    lay, hashes, index = layout(group(FULL), group(STATE)), make_hashes(5), {}
    cache_blocks(index, hashes, lay, 0, range(4))
    cache_blocks(index, hashes, lay, 1, [2])  # the state after 48 tokens only
    assert eagle_hit(lay, hashes, index) == LongestHit(
        48, (tuple(bid(0, i) for i in range(3)), (N, N, bid(1, 2)))
    )
    cache_blocks(index, hashes, lay, 1, [3])  # a state at 64 has no attention proof
    assert eagle_hit(lay, hashes, index).num_tokens == 48
    assert find_longest_hit(lay, hashes, NO_CAP, index.get).num_tokens == 64


def test_a_sliding_window_needs_its_window_and_the_block_after_it() -> None:
    """Window of 2 blocks: the EAGLE hit needs 3 contiguous cached blocks, as vLLM's."""
    lay, hashes = layout(group(FULL), group(SLIDING, 16, 33)), make_hashes(10)
    index: Index = {}
    cache_blocks(index, hashes, lay, 0, range(10))
    cache_blocks(index, hashes, lay, 1, [2, 3, 4, 7, 8])
    assert find_longest_hit(lay, hashes, NO_CAP, index.get).num_tokens == 144  # window 7, 8
    result = eagle_hit(lay, hashes, index)
    assert result.num_tokens == 64  # window 2, 3 + block 4
    assert result.block_ids[1] == (N, N, bid(1, 2), bid(1, 3))


def test_a_group_of_blocks_smaller_than_the_scheduler_block_proves_with_its_own_block() -> None:
    """Regression: the proof was a scheduler block in every group, where vLLM's is the
    group's own block. Full attention in blocks of 32, a window of 8 tokens in blocks of
    16: vLLM keeps the window's blocks for an EAGLE hit at 32 up to the block after it
    (blocks 1-2, what its offload connector loads 32 tokens from); kvtier asked for block
    3 too, which vLLM never keeps, and hit nothing."""
    lay, hashes, index = layout(group(FULL, 32), group(SLIDING, 16, 8)), make_hashes(4), {}
    cache_blocks(index, hashes, lay, 0, range(2))  # 64 tokens
    cache_blocks(index, hashes, lay, 1, [1, 2])
    assert eagle_hit(lay, hashes, index, 70) == LongestHit(32, ((bid(0, 1),), (N, bid(1, 1))))
    # Full attention in blocks of 16 beside a window in blocks of 32: 48 tokens prove 32.
    lay, index = layout(group(FULL, 16), group(SLIDING, 32, 50)), {}
    cache_blocks(index, hashes, lay, 0, range(3))
    cache_blocks(index, hashes, lay, 1, range(2))
    assert eagle_hit(lay, hashes, index, 63).num_tokens == 32


def test_fine_grained_hits_need_one_hash_block_after_them() -> None:
    lay = layout(group(FULL, 32), group(STATE, 16), hash_block_size=16)
    hashes, index = make_hashes(8), {}
    cache_blocks(index, hashes, lay, 0, range(3))  # 96 tokens
    cache_blocks(index, hashes, lay, 1, range(8))
    assert find_longest_hit(lay, hashes, NO_CAP, index.get, FINE).num_tokens == 96
    result = eagle_hit(lay, hashes, index, granularity=FINE)
    assert result.num_tokens == 80  # ends inside whole block 2, which serves it
    assert result.block_ids[0] == (bid(0, 1), bid(0, 3), bid(0, 5))


def only_group(lay: KVLayout, group_id: int) -> KVLayout:
    """The layout with every other group made scratch (group ids kept)."""
    groups = [
        g if i == group_id else dataclasses.replace(g, kind=SCRATCH, sliding_window=None)
        for i, g in enumerate(lay.groups)
    ]
    return layout(*groups, hash_block_size=lay.hash_block_size)


@hybrid_cases
@settings(max_examples=scaled_examples(300), deadline=None)
def test_the_eagle_hit_is_the_largest_length_accepted_with_its_proof(
    lay: KVLayout, num_hashes: int, cap: int, want_fine: bool, data: st.DataObject
) -> None:
    fine, cached, hashes, index = hybrid_case(lay, num_hashes, want_fine, data)
    result = eagle_hit(lay, hashes, index, cap, FINE if fine else COARSE)
    unit = lay.hash_block_size if fine else lay.scheduler_block_size
    covered = num_hashes * lay.hash_block_size

    def proven(t: int, group_id: int) -> bool:
        """The group accepts t + its proof (vLLM's margin: its block, or a hash block)."""
        spec = lay.groups[group_id]
        if spec.kind not in (FULL, SLIDING):
            return True
        proof = lay.hash_block_size if fine else spec.block_size
        return t + proof <= covered and reference_accepts(
            only_group(lay, group_id), cached, t + proof, fine
        )

    def accepts(t: int) -> bool:
        return reference_accepts(lay, cached, t, fine) and all(
            proven(t, g) for g in lay.cacheable_group_ids
        )

    assert result.num_tokens % unit == 0
    assert 0 <= result.num_tokens <= min(cap, covered)
    assert result.num_tokens == 0 or accepts(result.num_tokens)
    for t in range(result.num_tokens + unit, min(cap, covered) + 1, unit):
        assert not accepts(t), t
    check_block_ids(lay, cached, result)
