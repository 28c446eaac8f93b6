"""A sliding-window group under an EAGLE-style drafter whose blocks are cached to the end
of the request's hashes (a mutation run found no test of it: without the proven matcher's
cap at the hashes' end less one proof, the window's proof looked past the last hash)."""

from __future__ import annotations

from longest_hit_helpers import SLIDING, bid, cache_blocks, group, hit, layout, make_hashes

from kvtier.core.longest_hit import LongestHit


def test_a_window_fully_cached_to_the_last_hash_hits_one_proof_block_short() -> None:
    """Four 16-token blocks, all cached, window 32 tokens: the hit ends at 48 tokens (its
    proof, block 3, is the last hash), and serves the window's blocks 1 and 2."""
    lay, hashes, index = layout(group(SLIDING, 16, 32)), make_hashes(4), {}
    cache_blocks(index, hashes, lay, 0, range(4))
    found = hit(lay, hashes, index, eagle_proof=True)
    assert found.num_tokens == 48
    assert found == LongestHit(48, ((0, bid(0, 1), bid(0, 2)),))
