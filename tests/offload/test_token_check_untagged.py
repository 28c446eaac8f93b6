"""The token check never serves an untagged tier copy, not even where the looking-up
request has no tag to compare (a hash it holds twice)."""

from __future__ import annotations

from sim import Admission, SimEngine, config, full_layout
from test_token_check import H, self_colliding

from kvtier.core.keys import make_key
from kvtier.offload.plan import SlotRecord, Tier


def test_an_untagged_copy_of_a_hash_the_request_holds_twice_is_not_served() -> None:
    """A copy a run without the check kept carries no tag; a request whose chain holds
    its hash twice expects no tag for it either. None is no match: a miss."""
    engine = SimEngine(full_layout(), config(token_check=True), num_tier_blocks=8)
    assert engine.scheduler.restore(Tier.CPU, [(1, SlotRecord(make_key(H, 0), 4))]) == 1
    assert engine.scheduler.tier_pool.tag(1) is None
    tokens = [10, 11, 12, 13, 20, 21, 22, 23, 30]
    assert engine.admit(self_colliding("e", tokens)) == Admission(0, 0, 0)
    engine.check()
