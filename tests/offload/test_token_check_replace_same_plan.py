"""The records a tagged store's replacement drops go with the plan of that store.

The untagged copy's slot is freed as the store is selected, so the store may be written
into that very slot: naming the slot in a later plan's `forget_slots` would tombstone
the tagged copy's new record, and a restart would miss it (`PlanAssembler.build` takes
the dropped slots last, after the step's selection)."""

from __future__ import annotations

from sim import make_request
from test_scenarios_cascade import keys_of
from test_token_check_replace import disk_engine

from kvtier.offload.plan import SlotRecord, Tier


def test_no_later_plan_forgets_a_slot_a_replacing_store_wrote() -> None:
    engine = disk_engine()
    keys = keys_of(range(8), 2)
    untagged = [(1, SlotRecord(keys[0], 4)), (2, SlotRecord(keys[1], 4))]
    assert engine.scheduler.restore(Tier.DISK, untagged) == 2
    # Outputs: the prompt's blocks are confirmed, and selected, while the step's plan is
    # built (`select_scheduled`), not at the finish between steps.
    engine.run(make_request("a", [*range(8), 9], outputs=[90, 91, 92]))
    engine.drain()
    engine.step()  # a later plan: it would carry any drop the store's plan left behind
    assert not engine.scheduler.dropped_slots  # nor is one left for the shutdown to hand over
    plans = engine.worker.plans
    reused = False
    for i, plan in enumerate(plans):
        written = {
            slot for job in plan.jobs if job.dst_tier is Tier.DISK for slot in job.dst_block_ids
        }
        reused |= bool(written & {1, 2})
        later = {slot for p in plans[i + 1 :] for slot in p.forget_slots}
        assert not written & later, f"plan {plan.step_id} wrote slots a later plan forgets"
    assert reused  # the scenario bites: a tagged store went into a replaced copy's slot
    assert sorted(s for p in plans for s in p.forget_slots) == [1, 2]
    engine.check()
