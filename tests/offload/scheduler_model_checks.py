"""The random engine runs of `SchedulerDriver`, checked against a model (SPEC §6).

`SchedulerMachine` checks after every step and drains at teardown (the list of checks
is in `test_scheduler_stateful`'s docstring); `LazySchedulerMachine` runs it with lazy
store selection. `disk_tier_machines` adds the runs with a disk tier.
"""

from __future__ import annotations

from collections import Counter

from hypothesis.stateful import invariant
from restored_disk import OTHER_TAG
from scheduler_machine import SchedulerDriver
from scheduler_setup import Slot, tagged

from kvtier.core.events import AllCleared, BlockStored
from kvtier.core.keys import BlockHash, key_block_hash, key_group_id
from kvtier.offload.config import StoreMode
from kvtier.offload.plan import Tier


class SchedulerMachine(SchedulerDriver):
    """The driver's runs checked against the model after every step and at teardown.

    Eager store selection, no cascade; subclasses pick other modes.
    """

    # ------------------------------------------------------------ checks

    @invariant()
    def pools_are_consistent(self) -> None:
        self.engine.check()

    @invariant()
    def every_pin_is_explained(self) -> None:
        engine = self.engine
        worker = engine.worker
        scheduler = engine.scheduler
        queued_stores = scheduler.selector.queued
        want_tier: Counter[Slot] = Counter()
        for tier in scheduler.index.tiers:
            want_tier += tagged(tier.value, worker.in_flight_refs(tier.value))
        want_tier.update((scheduler.tier.value, b) for b in queued_stores.tier_block_ids)
        if scheduler.cascade is not None:
            for move in scheduler.cascade.queued:
                want_tier.update([("CPU", move.cpu_block_id), ("DISK", move.disk_block_id)])
        if scheduler.disk_set_aside is not None:
            # Disk slots of failed demotions or disk-only stores, held so that a bad one
            # is not reused first.
            want_tier.update(("DISK", b) for b in scheduler.disk_set_aside.held())
        want_gpu = worker.in_flight_refs("GPU") + engine.engine_refs()
        want_gpu.update(queued_stores.gpu_block_ids)
        for pin in self.lookup_pins.values():
            want_tier.update(pin)
        for load_tier, load_gpu in self.queued_loads.values():
            want_tier.update(load_tier)
            want_gpu.update(load_gpu)
        assert self.tier_refs() == +want_tier, "tier references"
        assert self.gpu_refs() == +want_gpu, "GPU references"

    @invariant()
    def visible_keys_were_stored_by_every_worker(self) -> None:
        engine = self.engine
        for tier, pool in engine.scheduler.index.pools.items():
            for key in engine.covered:
                slot = pool.cached_block(key)
                if slot is None:
                    continue
                assert (tier.value, key) in self.legit, (
                    f"a key is visible in {tier.value} without a completed copy"
                )
                for w, space in enumerate(engine.worker.lower[tier.value]):
                    content = space.get(slot)
                    if pool.tag(slot, key) == OTHER_TAG:
                        continue  # another prefix's KV (`restored_disk`): never served
                    if (tier.value, slot) in engine.worker.corrupted[w] and any(
                        e in engine.worker.in_flight
                        for e in engine.worker.named_by.get((tier.value, slot), ())
                    ):
                        continue  # found corrupted: dropped once that event is reported
                    assert key in engine.covered.get(content, ()), (
                        f"a visible key's bytes are wrong in {tier.value}"
                    )

    @invariant()
    def events_replay_to_what_the_tiers_hold(self) -> None:
        """With events on, each tier's events so far, replayed in order, name exactly the
        keys (primary and secondary) its blocks hold: one stored event per key a block
        took, one removed event per key it lost."""
        scheduler = self.engine.scheduler
        if not scheduler.config.events:
            return
        for event in scheduler.take_events():
            assert event.medium is not None, f"an event names no tier: {event}"
            held = self.event_keys.setdefault(event.medium, Counter())
            if isinstance(event, AllCleared):
                held.clear()
                continue
            named = (event.block_hash, event.group_id)
            held[named] += 1 if isinstance(event, BlockStored) else -1
            assert held[named] >= 0, f"{event} names a key {event.medium} does not hold"
        for tier, pool in scheduler.index.pools.items():
            want: Counter[tuple[BlockHash, int]] = Counter()
            for block_id in range(pool.num_blocks):
                key = pool.key(block_id)
                for k in [key, *pool.secondary_keys(block_id)] if key is not None else ():
                    want[(key_block_hash(k), key_group_id(k))] += 1
            got = +self.event_keys.get(tier.value, Counter())
            assert got == want, f"{tier.value}'s events describe other keys than it holds"

    @invariant()
    def quiet_stats_have_nothing_to_report(self) -> None:
        """`has_new_counts` and `stats_gauges` (the adapters' skip test) agree with `take_stats`."""
        scheduler = self.engine.scheduler
        quiet = not scheduler.has_new_counts()
        gauges = scheduler.stats_gauges()
        stats = scheduler.take_stats()
        assert gauges == (
            stats.num_tier_blocks_in_use,
            stats.num_blocks_pending_store,
            stats.num_disk_slots_held,
        )
        set_aside = scheduler.disk_set_aside
        assert stats.num_disk_slots_held == (len(set_aside.held()) if set_aside else 0)
        hits = sum(stats.hit_tokens.values())
        counts = (
            stats.store_outcomes,
            stats.handoff_outcomes,
            stats.num_loaded_blocks,
            stats.num_stored_blocks,
            stats.num_failed_loads,
            stats.num_failed_stores,
            stats.num_demoted_blocks,
            stats.num_failed_demotions,
            stats.num_dropped_demotions,
            stats.num_promoted_blocks,
            stats.num_lost_blocks,
        )
        if quiet:
            assert not any(counts), "a quiet step had counts"
            assert hits == self.hits_reported, "a quiet step had new hit tokens"
        self.hits_reported = hits
        assert not scheduler.has_new_counts(), "take_stats left counts behind"

    def teardown(self) -> None:
        """Drain: finish everything, complete every transfer; nothing may stay pinned."""
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        for request_id in self.live_ids():
            self.abort(request_id)
        for _ in range(10):
            self.complete_all()
            self.poll()
            if not engine.scheduler.has_pending_stores() and not engine.worker.in_flight:
                break
            self.run_step()
        cascade = engine.scheduler.cascade
        for _ in range(40):  # the disk works now: failed write-through demotions retried
            # (in lazy mode their steps store freed GPU blocks too, demoted in turn)
            busy = engine.scheduler.has_pending_stores() or engine.worker.in_flight
            if cascade is None or not (cascade.retry or busy):
                break
            self.run_step()
            engine.worker.complete_all()
            self.poll()
        assert cascade is None or not cascade.retry, "a failed demotion was never retried"
        assert cascade is None or not cascade.retrying, "a retry's report never came"
        self.check_drained()
        assert not engine.scheduler.has_pending_stores()
        self.every_pin_is_explained()
        self.visible_keys_were_stored_by_every_worker()
        set_aside = engine.scheduler.disk_set_aside
        held = len(set_aside) if set_aside is not None else 0  # until a reset
        for tier, pool in engine.scheduler.index.pools.items():
            left = held if tier is Tier.DISK else 0
            assert pool.num_free() == pool.num_usable_blocks - left, f"{tier.value} slots leaked"
        if held:
            assert engine.scheduler.reset()
            pools = engine.scheduler.index.pools.values()
            assert all(pool.num_free() == pool.num_usable_blocks for pool in pools)
        assert self.gpu_refs() == Counter(), "GPU blocks still pinned"
        engine.check()

    def complete_all(self) -> None:
        """Complete every in-flight job on every worker (the drain)."""
        self.engine.worker.complete_all()

    def check_drained(self) -> None:
        """Check the tiers once drained and the retries ran out (before any reset)."""


class LazySchedulerMachine(SchedulerMachine):
    """The same runs with lazy store selection."""

    mode = StoreMode.LAZY
