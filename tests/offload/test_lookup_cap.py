"""A capped lookup (`max_tokens`): the longest servable hit of at most that many tokens.

The vLLM adapter once dropped the last block of a tier hit for EAGLE-style drafters by
looking up again with a cap (it now asks for `eagle_drafter` hits, test_longest_hit_eagle).
Regression: it cut the hit short arithmetically, and in a hybrid layout the shorter
length needs other blocks (the state after it): the count it reported could not be
served, and the load failed.
"""

from __future__ import annotations

import pytest
from sim import Lookup, SimEngine, full_layout, make_request
from test_scenarios_hybrid import hybrid_engine, store_with_state_handoff


def test_a_capped_hit_in_a_hybrid_layout_is_one_the_tier_can_serve() -> None:
    engine = hybrid_engine()  # SPEC scenario 23's layout, fine-grained hits
    store_with_state_handoff(engine)
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
