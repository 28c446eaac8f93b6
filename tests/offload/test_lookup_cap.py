"""A capped lookup (`max_tokens`): the longest servable hit of at most that many tokens.

The vLLM adapter drops the last block of a tier hit for EAGLE-style drafters by looking
up again with a cap. Regression: it cut the hit short arithmetically, and in a hybrid
layout the shorter length needs other blocks (the state after it): the count it
reported could not be served, and the load failed.
"""

from __future__ import annotations

import pytest
from sim import Lookup, SimEngine, config, full_layout, make_request

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout


def _stored_state_engine() -> SimEngine:
    """SPEC scenario 23's layout: full attention in blocks of 32, a state every 16 tokens,
    fine-grained hits; the tier holds the full blocks and the state after 48 tokens."""
    layout = KVLayout(
        (KVGroupSpec(GroupKind.FULL_ATTENTION, 32, 64), KVGroupSpec(GroupKind.STATE, 16, 64))
    )
    engine = SimEngine(layout, config(fine_grained_hits=True), num_gpu_blocks=32)
    a = make_request("a", range(48), 16, outputs=[90, 91])
    engine.admit(a)
    for _ in range(2):
        engine.schedule("a")
        engine.step()
    engine.handoff("a", 1, engine.tables["a"][1][2])  # the state after 48 tokens
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    engine.drain()
    engine.evict_gpu()
    return engine


def test_a_capped_hit_in_a_hybrid_layout_is_one_the_tier_can_serve() -> None:
    engine = _stored_state_engine()
    b = make_request("b", [*range(48), 7], 16)
    assert engine.scheduler.lookup(b, 0) == 48
    capped = engine.scheduler.lookup(b, 0, 32)  # no state after 32 tokens: nothing to serve
    assert capped == 0
    assert engine.allocate(b, Lookup(0, [[], []], capped)) is not None
    assert not engine.scheduler.loads.queued
    assert "b" not in engine.scheduler.loads.recompute_next
    engine.check()


def test_a_capped_hit_of_full_attention_is_the_hit_cut_to_the_cap() -> None:
    engine = SimEngine(full_layout())
    engine.run(make_request("a", range(13)))
    engine.drain()
    engine.evict_gpu()
    b = make_request("b", [*range(12), 7])
    assert engine.scheduler.lookup(b, 0, 8) == 8
    assert engine.scheduler.lookup(b, 0, 7) == 4  # down to a whole block
    assert engine.scheduler.lookup(b, 0) == 12  # a new lookup replaces the capped pin
    engine.check()


@pytest.mark.parametrize("bad", [-1, True, 2.0])
def test_a_bad_cap_is_refused_naming_it(bad: object) -> None:
    engine = SimEngine(full_layout())
    with pytest.raises(ValueError, match=f"max_tokens must be an int >= 0, got {bad!r}"):
        engine.scheduler.lookup(make_request("b", range(9)), 0, bad)  # type: ignore[arg-type]
