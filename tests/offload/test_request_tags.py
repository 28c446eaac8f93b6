"""`RequestTags` (`offload/request_tags.py`), the token check's tags of live requests
(SPEC §3 Beyond): each hash block's tag chains onto the one before it, however the
request's tags grew; a GPU block's noted fill and a hand-off's tag answer for the key
they were computed under only."""

from __future__ import annotations

from sim import full_layout, make_request
from test_token_check import expected_tags

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import make_key
from kvtier.offload.request_tags import RequestTags


def test_tags_grown_with_the_request_chain_onto_its_earlier_ones() -> None:
    """Tags for a prompt of 2 hash blocks, then for 2 more its outputs filled: block j's
    tag chains onto block j-1's, the tags computed in one go for all 16 tokens (a mutant
    restarted the chain at each growth: block 2's tag no longer said what preceded it,
    and a tier copy tagged in one go never matched)."""
    tags = RequestTags(full_layout(block_size=4))
    request = make_request("r", range(8), outputs=range(100, 108))
    assert list(tags.of(request)) == expected_tags(list(range(8)))
    for _ in range(8):
        request.append_output()
    assert list(tags.of(request)) == expected_tags([*range(8), *range(100, 108)])


def test_a_noted_fill_answers_for_the_key_it_was_noted_under_only() -> None:
    """Request r fills GPU block 3 at position 1 (past its local prefix): the fill is
    noted under r's key of that position. Asked under another key (the block holds
    another hash since), there is no noted tag (a mutant answered r's tag for any key:
    a sharer stored other KV with it)."""
    tags = RequestTags(full_layout(block_size=4))
    request = make_request("r", range(12))
    key = make_key(request.block_hashes[1], 0)
    tag_of = tags.by_position(request, 0)
    assert tag_of(1, 3, key) == expected_tags(list(range(12)))[1]
    assert tags.noted(3, key) == expected_tags(list(range(12)))[1]
    assert tags.noted(3, make_key(request.block_hashes[2], 0)) is None


def test_a_handed_off_block_is_tagged_by_its_own_hash() -> None:
    """A hand-off names a GPU block, not a position: its tag is the request's tag of the
    hash the block's key holds, here hash block 1 of 3 (a mutant gave it the request's
    last tag, block 2's: another block's KV checked as this one's)."""
    tags = RequestTags(full_layout(block_size=4))
    request = make_request("r", range(12))
    expected = expected_tags(list(range(12)))
    assert list(tags.of(request)) == expected
    gpu = BlockPool(4)
    (block,) = gpu.allocate(1)
    key = make_key(request.block_hashes[1], 0)
    gpu.insert_key(key, block, 4)
    assert tags.of_block("r", gpu, block) == (key, expected[1])
    assert tags.of_block("another", gpu, block) is None
