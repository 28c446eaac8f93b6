"""The token check at positions counted against a request's local prefix: blocks appended
to its table count from the end of it (the fills noted for them before are forgotten); a
partial tail at the prefix's end is the request's own fill."""

from __future__ import annotations

from collisions import colliding, stored_by_a_sharer
from sim import Admission, SimEngine, config, full_layout, make_request


def test_a_block_appended_past_the_local_prefix_forgets_its_earlier_fill() -> None:
    """A fills blocks 0..3. D (its first 12 tokens A's, block 3 other tokens under A's
    hash: a collision) hits A's blocks 0 and 1 on the GPU (its local prefix: positions
    0 and 1), computes block 2 in a first chunk and block 3 in a second, appended into
    A's old block 3, and is preempted before a step notes it. B (hashed as A) shares
    D's blocks from the GPU cache and stores them. Block 3 holds D's KV: A's old note
    must be gone (the appended block is at position 3, not 0), or it is stored with
    A's tag and A's tokens are served D's KV."""
    engine = SimEngine(full_layout(), config(token_check=True), num_gpu_blocks=6)
    a_tokens = [*range(8), *range(100, 108), 1]
    engine.run(make_request("a", a_tokens))
    engine.drain()
    a_blocks = engine.worker.stores()[0].src_block_ids
    assert len(a_blocks) == 4
    tier = engine.scheduler.tier_pool
    for slot in range(1, tier.num_blocks):  # only later stores can serve A's tokens
        if tier.key(slot) is not None:
            tier.discard_keys(slot)
    for block in a_blocks[2:]:  # D hits blocks 0 and 1 only
        engine.gpu.discard_keys(block)
    engine.gpu.touch([a_blocks[2]])  # queue it last: D reuses A's block 3 at position 3
    engine.gpu.free([a_blocks[2]])
    d_tokens = [*range(8), *range(100, 104), *range(200, 204), 2]
    assert engine.admit(colliding("d", d_tokens, a_tokens)) == Admission(8, 0, 0)
    engine.schedule("d", 4)
    engine.step()
    engine.schedule("d", 4)  # appended: position 3
    engine.step()
    assert engine.tables["d"][0][3] == a_blocks[3]
    # D preempted before any step visits (and notes) its block 3
    assert stored_by_a_sharer(engine, [*d_tokens[:16], 9], a_tokens) == Admission(16, 0, 0)
    # Blocks 0..2 hold A's tokens (stored by B with A's and D's equal tags); block 3 not.
    assert engine.admit(make_request("a2", a_tokens)) == Admission(0, 12, 12)


def test_a_partial_tail_at_the_local_prefixs_end_is_stored_with_its_tag() -> None:
    """Fine-grained hits: b hits a's first 8-token block on the GPU (its local prefix
    ends at position 1) and computes 4 more tokens; its finish stores that partial tail
    at position 1, which b filled itself, with its tag: c, of b's first 12 tokens, hits
    all 12 in the tier."""
    layout = full_layout(block_size=8, hash_block_size=4)
    engine = SimEngine(layout, config(token_check=True, fine_grained_hits=True))
    engine.run(make_request("a", [*range(8), 1]))
    engine.drain()
    assert engine.admit(make_request("b", [*range(12), 2])) == Admission(8, 0, 0)
    engine.schedule("b")
    engine.step()
    engine.finish("b")
    engine.drain()
    engine.evict_gpu()
    assert engine.lookup(make_request("c", [*range(12), 3])).num_offered_tokens == 12
