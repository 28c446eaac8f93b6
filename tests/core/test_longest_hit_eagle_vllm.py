"""kvtier's EAGLE hits against a model of vLLM 0.33's hybrid prefix-cache lookup.

vLLM's coordinator asks each attention group for a hit of the candidate length plus
its margin (`eagle_proof_margin`: the group's block, or one hash block with fine-grained
lookups) and drops the margin again; a full-attention group then needs its prefix to
reach T + margin, a sliding window its window's blocks before T and its block at T; a
state group (Mamba) the state at T, with no margin. kvtier's hit must be the largest
aligned length this model accepts, so it ends where vLLM's own hits end. A 1-token
window is left out: it reads no other position, so kvtier asks it for no block at all
where vLLM still asks one.
"""

from __future__ import annotations

import math

from hypothesis import assume, settings
from hypothesis import strategies as st
from longest_hit_helpers import COARSE, FINE, FULL, SLIDING, STATE, layout
from test_longest_hit_properties import hybrid_case, hybrid_cases, reference_accepts

from example_counts import scaled_examples
from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import find_longest_hit


def vllm_accepts(
    lay: KVLayout, cached: dict[int, set[int]], t: int, fine: bool, covered: int
) -> bool:
    """Return True when vLLM's per-group EAGLE rules accept a hit of exactly t tokens."""
    hbs = lay.hash_block_size
    for g in lay.cacheable_group_ids:
        spec, have = lay.groups[g], cached[g]
        bs, k = spec.block_size, spec.block_size // hbs
        if spec.kind is FULL:
            margin = hbs if fine and bs > hbs else bs
            alone = layout(spec, hash_block_size=hbs)
            if t + margin > covered or not reference_accepts(alone, {0: have}, t + margin, fine):
                return False
        elif spec.kind is SLIDING:
            window = math.ceil((spec.sliding_window - 1) / bs)  # type: ignore[operator]
            blocks = range(max(0, t // bs - window), t // bs + 1)
            if t + bs > covered or any((j + 1) * k - 1 not in have for j in blocks):
                return False
        elif spec.kind is STATE and t > 0 and t // bs * k - 1 not in have:
            return False
    return True


@hybrid_cases
@settings(max_examples=scaled_examples(400), deadline=None)
def test_the_eagle_hit_is_vllms(
    lay: KVLayout, num_hashes: int, cap: int, want_fine: bool, data: st.DataObject
) -> None:
    assume(not any(g.kind is SLIDING and g.sliding_window == 1 for g in lay.groups))
    fine, cached, hashes, index = hybrid_case(lay, num_hashes, want_fine, data)
    granularity = FINE if fine else COARSE
    result = find_longest_hit(lay, hashes, cap, index.get, granularity, eagle_proof=True)
    unit = lay.hash_block_size if fine else lay.scheduler_block_size
    covered = num_hashes * lay.hash_block_size
    expected = 0
    for t in range(unit, min(cap, covered) + 1, unit):
        if reference_accepts(lay, cached, t, fine) and vllm_accepts(lay, cached, t, fine, covered):
            expected = t
    assert result.num_tokens == expected
