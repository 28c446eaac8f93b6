"""The token check under real step orders (SPEC §3 Beyond): stale notes, resets, sharers first."""

from __future__ import annotations

import pytest
from collisions import colliding
from sim import Admission, SimEngine, block_key, config, full_layout, make_request
from test_token_check import expected_tags

from kvtier.core.keys import make_key


def test_a_sharer_visiting_a_block_before_its_filler_does_not_lose_the_hit() -> None:
    """R computed blocks 0-1 last step; S shares them through the GPU cache and is
    selected first in the next step (vLLM yields new requests before running ones).
    S finds no noted fill and stores them untagged; R's own visit then sees IN_FLIGHT.
    The tier keeps untagged copies that the check never serves: an honest hit lost."""
    engine = SimEngine(
        full_layout(), config(token_check=True), num_gpu_blocks=16, num_tier_blocks=16
    )
    r = make_request("r", [*range(8), 8, 9, 10, 11, 12])
    engine.admit(r)
    engine.schedule("r", 8)
    engine.step()  # blocks 0-1 computed and cached on the GPU; R selects them next step
    s = make_request("s", [*range(8), 100])
    assert engine.admit(s) == Admission(8, 0, 0)
    engine.schedule("s")  # the new request first, as vLLM's yield_req_data orders them
    engine.schedule("r")
    engine.step()
    engine.finish("s")
    engine.finish("r")
    engine.drain()
    tier = engine.scheduler.tier_pool
    probe = make_request("k", range(8))
    tags = [
        tier.tag(tier.cached_block(block_key(engine.layout, probe, 0, i)) or 0) for i in range(2)
    ]
    engine.evict_gpu()
    assert tags == expected_tags(list(range(8)))[:2], tags
    assert engine.admit(make_request("t", [*range(8), 5])) == Admission(0, 8, 8)


@pytest.mark.parametrize("reset", [False, True], ids=["control", "reset"])
def test_a_request_whose_async_load_straddles_a_reset_keeps_its_local_prefix(reset: bool) -> None:
    """R shares A's blocks 0-1 through the GPU cache (hash collision: other tokens) and
    loads blocks 2-3 from the tier. The connector is reset while the load is in flight
    (`reset` clears `RequestTags._local`). vLLM then calls update_state_after_alloc(R,
    blocks, 0) when it admits R for compute: `on_allocated` tracks R again, with floor 0,
    so A's KV at positions 0-1 is stored under R's tags."""
    engine = SimEngine(
        full_layout(), config(token_check=True), num_gpu_blocks=24, num_tier_blocks=16
    )
    a_tokens = [*range(8), 8]
    x = [60, 61, 62, 63, 64, 65, 66, 67]
    r_tokens = [50, 51, 52, 53, 54, 55, 56, 57, *x, 99]
    hashed = [*range(8), *x, 99]
    # Q (R's tokens) puts blocks 0-3 in the tier with R's tags.
    engine.run(colliding("q", r_tokens, hashed))
    engine.drain()
    engine.evict_gpu()
    # A (other tokens, same hashes for blocks 0-1): a tag miss; computes them on the GPU.
    engine.run(make_request("a", a_tokens))
    engine.drain()
    tier = engine.scheduler.tier_pool
    for key in (block_key(engine.layout, make_request("k", a_tokens), 0, i) for i in range(2)):
        slot = tier.cached_block(key)
        assert slot is not None
        tier.discard_keys(slot)  # Q's copies of blocks 0-1 age out of the tier
    r = colliding("r", r_tokens, hashed)
    assert engine.admit(r) == Admission(8, 8, 8)  # A's GPU blocks 0-1, the tier's 2-3
    engine.auto_complete = False
    engine.step()  # the load is issued
    if reset:
        assert engine.scheduler.reset() is False  # transfers in flight: retry later
    engine.worker.complete_all()
    engine.poll()
    assert "r" not in engine.loading
    engine.auto_complete = True
    # vLLM: the async-loaded request is admitted for compute -> update_state_after_alloc(.., 0)
    engine.scheduler.on_allocated(r, engine.tables["r"], 0)
    engine.schedule("r")
    engine.step()
    engine.finish("r")
    engine.drain()
    a_keys = [block_key(engine.layout, make_request("k", a_tokens), 0, i) for i in range(2)]
    r_tags = expected_tags(r_tokens)
    for i, key in enumerate(a_keys):
        slot = tier.cached_block(key)
        if slot is not None:  # the GPU block holds A's KV: never R's tag
            assert tier.tag(slot) != r_tags[i], f"block {i}: A's KV stored with R's tag"
    engine.evict_gpu()
    # T has R's tokens: the tier must not serve it A's KV for blocks 0-1.
    admission = engine.admit(colliding("t", r_tokens, hashed))
    assert admission is not None
    assert admission.num_accepted_tokens == 0


def test_a_stale_noted_fill_is_not_read_before_the_filler_forgets_it() -> None:
    """vLLM caches a block in the GPU prefix cache when it allocates it (before it is
    computed) and yields new requests before running ones. F filled GPU block g under key
    K (noted: F's tag). R (other tokens, colliding hash K; skip_prefix_cache, so it
    computes) is given g again for its block 0: g is cached under K at allocation. S
    (F's tokens) is admitted in the same step with a local hit on g. In build_plan S is
    selected first: `noted(g, K)` still returns F's tag (R's `forget_fills` runs later in
    the same loop), so R's KV is stored under F's tag and a later lookup with F's tokens
    is served R's KV."""
    engine = SimEngine(
        full_layout(), config(token_check=True), num_gpu_blocks=16, num_tier_blocks=16
    )
    f_tokens = [*range(8), 8]
    engine.run(make_request("f", f_tokens))
    engine.drain()
    f_keys = [block_key(engine.layout, make_request("k", f_tokens), 0, i) for i in range(2)]
    tier = engine.scheduler.tier_pool
    for key in f_keys:
        tier.discard_keys(tier.cached_block(key) or 0)  # F's tier copies age out
    f_blocks = [engine.gpu.cached_block(k) for k in f_keys]
    assert None not in f_blocks
    gpu = engine.gpu
    held = [b for b in range(1, gpu.num_blocks) if b != f_blocks[0] and gpu.ref_count(b) == 0]
    gpu.touch(held)  # R's block 0 can only be F's former block 0
    r = colliding("r", [50, 51, 52, 53, 54, 55, 56, 57, 58], f_tokens)
    r.skip_prefix_cache = True
    assert engine.admit(r) == Admission(0, 0, 0)
    engine.schedule("r", 4)
    r_blocks = list(engine.tables["r"][0])
    assert r_blocks == f_blocks[:1]
    for pos, block in enumerate(r_blocks):  # vLLM: cached at allocation
        if gpu.key(block) is None:
            gpu.insert_key(make_key(r.block_hashes[pos], 0), block, 4)
        # one batch: R's write precedes S's read in every layer
        engine.worker.write_gpu(block, make_key(r.block_hashes[pos], 0))
    gpu.free(held)
    s = make_request("s", f_tokens)
    admission = engine.admit(s)
    assert admission is not None
    assert admission.num_local_tokens == 8
    engine.schedule("s")
    engine._scheduled = {"s": engine._scheduled["s"], "r": engine._scheduled["r"]}  # new first
    engine.step()
    engine.schedule("r")
    engine.step()
    engine.finish("s")
    engine.finish("r")
    engine.drain()
    f_tags = expected_tags(f_tokens)
    for pos, block in enumerate(r_blocks):
        key = make_key(r.block_hashes[pos], 0)
        slot = tier.cached_block(key)
        if slot is not None and f_blocks[pos] == block:  # R refilled F's block under F's key
            assert tier.tag(slot) != f_tags[pos], f"block {pos}: R's KV stored with F's tag"


def test_a_request_running_across_a_reset_is_stored_again_only_once_admitted_afresh() -> None:
    """SPEC §6.9: a request running across a reset is no longer stored, even when its
    engine allocates it again without a lookup (an async load's second `on_allocated`);
    preempted and looked up again, it starts afresh. A finished one leaves nothing."""
    engine = SimEngine(full_layout(), config())
    a = make_request("a", range(8), outputs=[1, 2, 3])
    b = make_request("b", range(100, 108), outputs=[1])
    engine.admit(a)
    engine.admit(b)
    engine.schedule("a", 4)
    engine.schedule("b", 4)
    engine.step()
    assert engine.scheduler.reset()
    engine.finish("b")  # finished without a fresh admission
    engine.scheduler.on_allocated(a, engine.tables["a"], 0)
    assert "a" not in engine.scheduler.selector.tracked
    again = engine.preempt("a")
    engine.admit(again)  # a new lookup: admitted afresh
    assert "a" in engine.scheduler.selector.tracked
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    engine.drain()
    assert engine.worker.stores(), "stored again after its fresh admission"
    assert engine.scheduler.selector.across_reset == set()
