"""The token check and sliding-window positions recovered from the GPU cache by key."""

from __future__ import annotations

from collisions import colliding
from sim import Admission, SimEngine, block_key, config, make_request

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.core.token_tags import token_tag
from kvtier.offload.transfers import FailedLoad


def test_a_recovered_window_block_keeps_the_tag_of_its_own_fill() -> None:
    """B (hashed as A, other tokens: a collision) fills window blocks; the tier forgets
    them. A computes its own blocks, its window drops positions 0 and 1, and its finish
    recovers them by key from the GPU cache: B's older copies. Those hold B's KV, so
    they are stored with B's noted tags, never A's (SPEC §6.5, the token check): a
    request of A's first 8 tokens must not be served them."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4),
        )
    )
    engine = SimEngine(layout, config(token_check=True), num_gpu_blocks=40, num_tier_blocks=16)
    a_tokens = [*range(12), 1]
    engine.admit(colliding("b", [*range(50, 62), 1], a_tokens))
    engine.schedule("b")
    engine.step()
    b_first = engine.tables["b"][0][0]
    b_window = list(engine.tables["b"][1])
    engine.finish("b")
    engine.drain()
    tier = engine.scheduler.tier_pool
    for slot in range(1, tier.num_blocks):  # only A's stores can serve A's tokens
        if tier.key(slot) is not None:
            tier.discard_keys(slot)
    engine.gpu.discard_keys(b_first)  # A misses its first block: it computes all
    assert engine.admit(make_request("a", a_tokens)) == Admission(0, 0, 0)
    engine.schedule("a")
    engine.step()
    engine.drop_blocks("a", 1, [0, 1])
    engine.finish("a")
    (store,) = engine.step().jobs
    assert set(b_window[:2]) <= set(store.src_block_ids)  # recovered: B's copies
    engine.drain()
    engine.evict_gpu()
    assert engine.lookup(make_request("a2", [*range(8), 90])).num_offered_tokens == 0
    engine.check()


def test_a_shorter_acceptance_checks_the_tags_of_the_blocks_it_looks_up_again() -> None:
    """SPEC §6.3 (scenario 6, hybrid) with the token check on: accepting 8 of 20
    offered tokens looks up sliding-window block 1 again (the 20-token hit left it
    null). That block's tag is not the request's (a collision's KV under its key): the
    re-lookup misses it as the first lookup would have, so the load fails and the
    request recomputes; it is never loaded."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4),
        )
    )
    engine = SimEngine(layout, config(token_check=True), num_gpu_blocks=32, num_tier_blocks=16)
    engine.run(make_request("a", range(20)))
    engine.drain()
    engine.evict_gpu()
    b = make_request("b", [*range(20), 7])
    tier = engine.scheduler.tier_pool
    key = block_key(layout, b, 1, 1)
    slot = tier.cached_block(key)
    assert slot is not None
    tier.discard_keys(slot)
    tier.touch([slot])
    tier.insert_key(key, slot, 4, tag=token_tag(None, [90, 91, 92, 93], ()))
    tier.free([slot])
    found = engine.lookup(b)
    assert found.num_offered_tokens == 20  # the 20-token hit does not need block 1
    engine.allocate(b, found, 8)
    plan = engine.step()
    assert not [job for job in plan.jobs if job.is_load]
    assert engine.outcomes[-1].failed_loads == (FailedLoad("b", 0, 8),)
    assert engine.scheduler.take_stats().num_tag_mismatches == 1
    engine.schedule("b")
    engine.step()
    engine.check()
