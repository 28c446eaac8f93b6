"""EAGLE-style drafter hits through the offload scheduler (`eagle_proof`, SPEC §5).

The proof block after a hit is looked up, never pinned, never loaded and never counted:
checked against a brute-force hit over what the tier holds, for random prompts sharing
prefixes (one full-attention group of 4-token blocks).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from sim import SimEngine, block_key, config, full_layout, make_request

from example_counts import scaled_examples
from kvtier.offload.plan import Tier

prompts = st.lists(st.integers(0, 2), min_size=6, max_size=30)


def eagle_engine() -> SimEngine:
    engine = SimEngine(full_layout(), config(), num_gpu_blocks=64, num_tier_blocks=64)
    engine.scheduler.loads.eagle_proof = True
    return engine


@given(
    stored=st.lists(prompts, min_size=1, max_size=5),
    which=st.integers(0, 4),
    cut=st.integers(4, 30),
    suffix=st.lists(st.integers(0, 2), max_size=6),
)
@settings(max_examples=scaled_examples(200), deadline=None)
def test_an_eagle_hit_pins_and_loads_exactly_the_blocks_before_its_proof(
    stored: list[list[int]], which: int, cut: int, suffix: list[int]
) -> None:
    query = [*stored[which % len(stored)][:cut], *suffix]
    engine = eagle_engine()
    for i, tokens in enumerate(stored):
        engine.run(make_request(f"s{i}", tokens))
    engine.drain()
    engine.evict_gpu()
    tier = engine.scheduler.index.pools[Tier.CPU]
    q = make_request("q", query)
    slots = []  # the tier slot of each of q's whole blocks, while cached
    for pos in range(len(q.block_hashes)):
        slot = tier.cached_block(block_key(engine.layout, q, 0, pos))
        if slot is None:
            break
        slots.append(slot)
    # Brute force: T whole blocks, within the last-token cap, with block T/4 cached.
    expected = 0
    for blocks in range(1, len(slots)):
        if blocks * 4 <= q.num_tokens - 1:
            expected = blocks * 4
    found = engine.lookup(q)
    assert found.num_local_tokens == 0
    assert found.num_offered_tokens == expected
    pin = engine.scheduler.loads.pins.get("q")
    assert (pin.pinned if pin else []) == slots[: expected // 4][::-1]
    admission = engine.allocate(q, found)
    assert admission is not None
    loads = engine.scheduler.loads.queued
    assert [b for load in loads for b in load.tier_block_ids] == slots[: expected // 4]
    assert {(p.start_token, p.end_token) for p in (load.progress for load in loads)} <= {
        (0, expected)
    }
    before = sum(engine.scheduler.loads.hit_tokens.values())
    while "q" in engine.loading:
        engine.step()
    while not q.is_done:  # computing checks every block q reads holds q's prefix
        engine.schedule("q")
        engine.step()
    assert sum(engine.scheduler.loads.hit_tokens.values()) - before == expected
    engine.finish("q")
    engine.drain()
    engine.check()
