"""Tier lookups of a layout whose only group slides over a window of one token (SPEC §5,
§6.2): it needs no block before a hit, so a hit is proven by the block that ends it, and
it serves no block at all.

Requests are admitted as vLLM's connector sees them: the engine's own cache missed
(vLLM's manager finds no hit for a prompt it never cached), then the tier is asked.
Regressions: the tier offered every prompt (one never stored too) as a hit of all its
whole blocks, and `on_allocated` then divided by the number of blocks to load (0). A
tier hit that loads nothing is now no hit: its tokens are recomputed.
"""

from __future__ import annotations

from sim import Admission, Lookup, SimEngine, block_key, config, make_request
from sim_request import SimRequest

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout

LAYOUT = KVLayout((KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 1),))


def engine() -> SimEngine:
    return SimEngine(LAYOUT, config(), num_gpu_blocks=16, num_tier_blocks=16)


def admit_after_a_local_miss(sim: SimEngine, request: SimRequest) -> Admission | None:
    sim.learn_chain(request)
    return sim.allocate(request, Lookup(0, [[]], sim.scheduler.lookup(request, 0)))


def test_a_prompt_never_stored_is_no_tier_hit() -> None:
    sim = engine()
    assert admit_after_a_local_miss(sim, make_request("a", range(13))) == Admission(0, 0, 0)


def test_a_stored_prompt_loads_nothing_so_it_is_no_tier_hit() -> None:
    sim = engine()
    a = make_request("a", range(13), outputs=[50])
    assert admit_after_a_local_miss(sim, a) == Admission(0, 0, 0)
    while not a.is_done:
        sim.schedule("a")
        sim.step()
    sim.finish("a")
    sim.drain()
    sim.evict_gpu()
    b = make_request("b", range(13), outputs=[50])
    assert sim.scheduler.tier_pool.cached_block(block_key(LAYOUT, b, 0, 2)) is not None
    assert admit_after_a_local_miss(sim, b) == Admission(0, 0, 0)
    assert sim.loading == {}
    sim.check()
