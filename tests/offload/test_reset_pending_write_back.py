"""While a reset waits, write-back demotes nothing, not even KV stored since the reset
(`PlanAssembler.build` with `walk` False): a retry of the reset abandons whatever is in
flight, so demotions issued while it waits would keep an engine that retries every step
waiting (tier_reset: lazy walks and write-back demotions pause)."""

from __future__ import annotations

from sim import make_request
from test_scenarios_cascade import cascade_engine, holds, keys_of

from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier


def test_kv_stored_while_a_reset_waits_is_not_demoted_before_it_succeeds() -> None:
    engine = cascade_engine(CascadeMode.WRITE_BACK, num_cpu=9, num_disk=12)
    old = engine.store_of_finished(make_request("old", range(300, 308)))  # left in flight
    assert engine.scheduler.reset() is False
    engine.evict_gpu()
    engine.admit(make_request("new", range(400, 432)))
    engine.schedule("new")
    engine.step()
    engine.finish("new")
    for _ in range(4):  # the new request's store completes; the old one stays in flight
        plan = engine.step()
        demotions = [j for j in plan.jobs if (j.src_tier, j.dst_tier) == (Tier.CPU, Tier.DISK)]
        assert not demotions, "a demotion while the reset waits"
        for job in plan.jobs:
            engine.worker.complete(job.event_id)
        engine.poll()
        engine.check()
    new_keys = keys_of(range(400, 432), 4)
    assert all(holds(engine, Tier.CPU, key) for key in new_keys)  # stored since the reset
    assert not any(holds(engine, Tier.DISK, key) for key in new_keys)
    engine.worker.complete(old.event_id)
    engine.poll()
    assert engine.scheduler.reset() is True
