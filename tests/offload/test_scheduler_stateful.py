"""Random engine runs against the offload scheduler, checked against a model (SPEC §6).

Requests share prefixes (two families), are admitted taking all, none or part of their
tier hit, run in chunks, decode, finish, are preempted or aborted; the GPU cache is
evicted and the scheduler reset at random; 1-4 fake workers complete, delay, fail or
re-report transfers in any order. Eager mode runs with and without fine-grained hits.
After every step:

- the scheduler's and the GPU pool's own invariants hold;
- every reference on a GPU block or tier slot is explained by the engine's tables, a
  lookup pin, a queued load or store, or a transfer not every worker has reported — so
  nothing stays pinned for a request that is gone once its transfers are reported;
- a key is visible in the tier only if a store holding it completed on every worker
  without failure and was not abandoned by a reset, and every worker holds its bytes;
- loads deliver the right content (`SimEngine.check_kv`, on load completion and before
  every forward pass).

At teardown everything is drained: every tier slot is free and the GPU holds no pin.

Each step's many small choices come from one drawn seed: with one draw per choice,
Hypothesis spent most of the time generating data and ran far fewer steps. `note()`
records the choices, so a failing example still reads as a story.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from sim import SimEngine, SimRequest, config, full_layout, make_request

from kvtier.core.keys import Key
from kvtier.offload.config import CascadeMode, OffloadConfig, StoreMode
from kvtier.offload.plan import Tier

HASH_BLOCK = 4
FAMILIES = [[1000 * f + i for i in range(12)] for f in range(2)]
MAX_LIVE_REQUESTS = 4
SEEDS = st.integers(0, 2**32 - 1)
WORKER_ACTIONS = ["done"] * 6 + ["wait"] * 3 + ["fail"]


def refs(pool_refs: list[int]) -> Counter[int]:
    return Counter({b: r for b, r in enumerate(pool_refs) if r})


Slot = tuple[str, int]  # (lower tier name, block id)


def tagged(tier_name: str, counts: Counter[int]) -> Counter[Slot]:
    return Counter({(tier_name, b): n for b, n in counts.items()})


class SchedulerMachine(RuleBasedStateMachine):
    """Drive a `SimEngine` at random; subclasses pick the store mode.

    There is one rule, `step`, so that no example is wasted on rules Hypothesis
    switched off (it disables rules at random per example).
    """

    mode = StoreMode.EAGER
    cascade: CascadeMode | None = None

    def __init__(self) -> None:
        super().__init__()
        self.engine: SimEngine
        self.waiting: dict[str, SimRequest] = {}  # new or preempted: no GPU blocks
        self.lookup_pins: dict[str, Counter[Slot]] = {}  # tier slots a lookup pinned
        self.queued_loads: dict[str, tuple[Counter[Slot], Counter[int]]] = {}  # tier, GPU
        self.abandoned: set[int] = set()  # store and demotion events in flight at a reset
        self.legit: set[tuple[str, Key]] = set()  # (tier, key) a completed, kept copy holds
        self.expect_failed: set[str] = set()  # queued loads a reset dropped
        self.num_seen_reports = 0
        self.next_id = 0
        self.hits_reported = 0  # cumulative hit tokens at the last take_stats

    @initialize(
        num_workers=st.integers(1, 4),
        num_gpu_blocks=st.integers(8, 16),
        num_tier_blocks=st.integers(3, 8),
        fine=st.booleans(),
        num_disk_blocks=st.integers(3, 10),
    )
    def setup(
        self,
        num_workers: int,
        num_gpu_blocks: int,
        num_tier_blocks: int,
        fine: bool,
        num_disk_blocks: int,
    ) -> None:
        """Build the engine: one full-attention group of 4 (or 8 with fine-grained hits).

        A cascade machine puts a disk tier of `num_disk_blocks` behind the CPU tier.
        """
        fine = fine and self.mode is StoreMode.EAGER
        layout = full_layout(8, HASH_BLOCK) if fine else full_layout(4)
        cfg = config(store_mode=self.mode, max_batched_tokens=8, fine_grained_hits=fine)
        if self.cascade is not None:
            cfg = OffloadConfig(
                cpu_bytes=1 << 20,
                disk_bytes=1 << 21,
                disk_path="unused-by-the-fake-worker",
                cascade=self.cascade,
                store_mode=self.mode,
                max_batched_tokens=8,
                fine_grained_hits=fine,
            )
        self.engine = SimEngine(
            layout,
            cfg,
            num_gpu_blocks=num_gpu_blocks,
            num_tier_blocks=num_tier_blocks,
            num_workers=num_workers,
            num_disk_blocks=num_disk_blocks if self.cascade is not None else 0,
        )
        self.engine.auto_complete = False

    # ------------------------------------------------------------ the rule

    @rule(seed=SEEDS)
    def step(self, seed: int) -> None:
        """One engine step, with incidents around it.

        Arrivals, sometimes a GPU cache eviction (so hits must come from the tier),
        admissions, and before or after them sometimes an abort, a reset or a report;
        then preempt, schedule chunks, plan, compute, let the workers act, report, finish.
        """
        rng = random.Random(seed)
        engine = self.engine
        while len(self.live_ids()) < MAX_LIVE_REQUESTS and rng.randrange(3) == 0:
            self.arrive(rng)
        incident, after_admission = rng.randrange(10), rng.randrange(2)
        if not after_admission:
            self.incident(incident, rng)
        if rng.randrange(3) == 0:
            note("evict the GPU cache")
            engine.evict_gpu()
        for request_id in sorted(self.waiting):
            if rng.randrange(4):
                self.admit(request_id, rng)
        if after_admission:  # queued loads and lookup pins exist only now
            self.incident(incident, rng)
        preempted = []
        for request_id in sorted(engine.requests):
            if not engine.is_runnable(request_id):
                continue
            if rng.randrange(10) == 0:
                note(f"preempt {request_id}")
                preempted.append(engine.preempt(request_id))
                continue
            request = engine.requests[request_id]
            chunk = min(request.num_tokens - request.num_computed_tokens, rng.randint(1, 12))
            if engine.gpu.can_allocate(engine.num_blocks_to_schedule(request_id, chunk)):
                note(f"schedule {chunk} tokens of {request_id}")
                engine.schedule(request_id, chunk)
        self.run_step()
        self.work(rng)
        for request in preempted:
            self.waiting[request.request_id] = request
        for request_id in sorted(engine.requests):
            if engine.is_runnable(request_id) and engine.requests[request_id].is_done:
                note(f"finish {request_id}")
                engine.finish(request_id)

    # ------------------------------------------------------------ actions

    def arrive(self, rng: random.Random) -> None:
        """A request arrives: part of a family prefix, a suffix, outputs to sample."""
        family = FAMILIES[rng.randrange(len(FAMILIES))]
        prefix = family[: HASH_BLOCK * rng.choice([0, 1, 2, 2, 3, 3])]
        tokens = prefix + [rng.randrange(3) for _ in range(rng.randrange(6))] or [7]
        outputs = [rng.randrange(3) for _ in range(rng.randrange(4))]
        request_id = f"r{self.next_id}"
        self.next_id += 1
        note(f"arrive {request_id}: {tokens} then {outputs}")
        self.waiting[request_id] = make_request(request_id, tokens, HASH_BLOCK, outputs=outputs)

    def admit(self, request_id: str, rng: random.Random) -> None:
        """Admit a waiting request, taking all, none or part of its tier hit.

        The tier and GPU references `lookup` and `on_allocated` add are recorded as the
        request's lookup pin or queued load, after checking they match the hit.
        """
        request = self.waiting[request_id]
        engine = self.engine
        old_pin = self.lookup_pins.pop(request_id, Counter())
        before = self.tier_refs()
        found = engine.lookup(request)
        pin = self.tier_refs()
        pin.subtract(before)
        pin.update(old_pin)
        pin = +pin
        offered = found.num_offered_tokens
        assert found.num_local_tokens + offered <= request.num_tokens - 1
        assert offered % HASH_BLOCK == 0
        accepted = rng.choice(
            [offered, offered, 0, rng.randint(0, offered // self.block_size) * self.block_size]
        )
        note(f"admit {request_id}: {found.num_local_tokens} local + {accepted} of {offered}")
        tier_before, gpu_before = self.tier_refs(), self.gpu_refs()
        out_of_budget = rng.randrange(8) == 0  # the engine stops admitting after lookup
        if out_of_budget or engine.allocate(request, found, accepted) is None:
            note(f"{request_id} not allocated: its lookup pin stays")
            if pin:
                self.lookup_pins[request_id] = pin
            return
        del self.waiting[request_id]
        load_tier = self.tier_refs()
        load_tier.subtract(tier_before)
        load_tier.update(pin)
        load_gpu = self.gpu_refs()
        load_gpu.subtract(gpu_before)
        load_gpu.subtract(b for b in engine.tables[request_id][0] if b)
        assert all(n >= 0 for n in load_tier.values()), "on_allocated released a pin twice"
        load_tier, load_gpu = +load_tier, +load_gpu
        first = found.num_local_tokens // self.block_size
        num_blocks = -(-accepted // self.block_size)
        assert load_gpu == Counter(engine.tables[request_id][0][first : first + num_blocks])
        assert sum(load_tier.values()) == num_blocks
        assert not load_tier - pin, "a load reads a slot its lookup did not pin"
        if accepted:
            self.queued_loads[request_id] = (load_tier, load_gpu)

    def run_step(self) -> None:
        """Plan, submit, compute; the plan must load exactly the queued loads."""
        engine = self.engine
        queued = self.queued_loads
        num_plans = len(engine.worker.plans)
        engine.step()
        (plan,) = engine.worker.plans[num_plans:]
        note(f"plan: {plan}")
        loads = [job for job in plan.jobs if job.is_load]
        want_tier: Counter[Slot] = sum((q[0] for q in queued.values()), Counter())
        want_gpu: Counter[int] = sum((q[1] for q in queued.values()), Counter())
        got_tier = Counter((job.src_tier.value, b) for job in loads for b in job.src_block_ids)
        got_gpu = Counter(b for job in loads for b in job.dst_block_ids)
        assert (got_tier, got_gpu) == (want_tier, want_gpu), "the plan's loads differ from queued"
        self.queued_loads = {}
        self.learn_reports()

    def work(self, rng: random.Random) -> None:
        """Workers complete, delay or fail in-flight jobs, maybe re-report one; then report."""
        worker = self.engine.worker
        if worker.reported and rng.randrange(8) == 0:
            event_id = rng.choice(sorted(worker.reported))
            note(f"re-report event {event_id}")
            worker.duplicate(event_id)
        for event_id in sorted(worker.in_flight):
            for w in sorted(worker.in_flight[event_id].waiting):
                action = rng.choice(WORKER_ACTIONS)
                if action != "wait":
                    note(f"worker {w}: event {event_id} {action}")
                if action == "done":
                    worker.complete(event_id, [w])
                elif action == "fail":
                    worker.fail(event_id, [w])
        self.poll()

    def incident(self, incident: int, rng: random.Random) -> None:
        """Sometimes abort a request, reset the scheduler or report between steps."""
        if incident == 0 and self.live_ids():
            self.abort(rng.choice(self.live_ids()))
        elif incident == 1:
            self.reset()
        elif incident in (2, 3):
            self.work(rng)

    def abort(self, request_id: str) -> None:
        """Finish a live request early, whatever it is doing (waiting, loading, running)."""
        note(f"abort {request_id}")
        self.engine.finish(request_id, self.waiting.pop(request_id, None))
        self.lookup_pins.pop(request_id, None)
        self.queued_loads.pop(request_id, None)

    def reset(self) -> None:
        """Reset the scheduler: pins dropped, queued loads failed, in-flight stores abandoned."""
        worker = self.engine.worker
        self.abandoned |= {
            e for e, flight in worker.in_flight.items() if flight.job.dst_tier is not Tier.GPU
        }
        self.expect_failed = set(self.queued_loads)
        self.lookup_pins.clear()
        self.queued_loads = {}
        cleared = self.engine.scheduler.reset()
        note(f"reset -> {cleared}")
        assert cleared == (not worker.in_flight)
        if cleared:
            self.legit.clear()
        self.poll()

    def poll(self) -> None:
        """Apply the workers' report; loads a reset dropped must come back failed."""
        outcome = self.engine.poll()
        failed = {f.request_id for f in outcome.failed_loads}
        assert self.expect_failed <= failed, "a load dropped by reset was not reported failed"
        self.expect_failed = set()
        self.learn_reports()

    def learn_reports(self) -> None:
        """Add the keys of stores and demotions every worker finished (not failed/abandoned).

        A demotion copies whatever its CPU source held; it counts only if that was legit.
        """
        reported = list(self.engine.worker.reported.items())
        for event_id, flight in reported[self.num_seen_reports :]:
            job = flight.job
            if job.dst_tier is Tier.GPU or flight.failed or event_id in self.abandoned:
                continue
            dst = job.dst_tier.value
            for content in flight.sources[0]:
                for key in self.engine.covered.get(content, ()):
                    if job.src_tier is Tier.GPU or (job.src_tier.value, key) in self.legit:
                        self.legit.add((dst, key))
        self.num_seen_reports = len(reported)

    # ------------------------------------------------------------ checks

    @property
    def block_size(self) -> int:
        return self.engine.layout.groups[0].block_size

    def live_ids(self) -> list[str]:
        return sorted([*self.waiting, *self.engine.requests])

    def tier_refs(self) -> Counter[Slot]:
        counts: Counter[Slot] = Counter()
        for tier, pool in self.engine.scheduler.index.pools.items():
            counts += tagged(tier.value, refs([pool.ref_count(b) for b in range(pool.num_blocks)]))
        return counts

    def gpu_refs(self) -> Counter[int]:
        gpu = self.engine.gpu
        return refs([gpu.ref_count(b) for b in range(gpu.num_blocks)])

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
        want_tier.update((scheduler.tier.value, item.tier_block_id) for item in queued_stores)
        if scheduler.cascade is not None:
            for move in scheduler.cascade.queued:
                want_tier.update([("CPU", move.cpu_block_id), ("DISK", move.disk_block_id)])
        want_gpu = worker.in_flight_refs("GPU") + engine.engine_refs()
        want_gpu.update(item.gpu_block_id for item in queued_stores)
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
                for space in engine.worker.lower[tier.value]:
                    content = space.get(slot)
                    assert key in engine.covered.get(content, ()), (
                        f"a visible key's bytes are wrong in {tier.value}"
                    )

    @invariant()
    def quiet_stats_have_nothing_to_report(self) -> None:
        """`has_new_counts` and `stats_gauges` (the adapters' skip test) agree with `take_stats`."""
        scheduler = self.engine.scheduler
        quiet = not scheduler.has_new_counts()
        gauges = scheduler.stats_gauges()
        stats = scheduler.take_stats()
        assert gauges == (stats.num_tier_blocks_in_use, stats.num_blocks_pending_store)
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
            engine.worker.complete_all()
            self.poll()
            if not engine.scheduler.has_pending_stores() and not engine.worker.in_flight:
                break
            self.run_step()
        assert not engine.scheduler.has_pending_stores()
        self.every_pin_is_explained()
        self.visible_keys_were_stored_by_every_worker()
        for tier, pool in engine.scheduler.index.pools.items():
            assert pool.num_free() == pool.num_usable_blocks, f"{tier.value} slots leaked"
        assert self.gpu_refs() == Counter(), "GPU blocks still pinned"
        engine.check()


class LazySchedulerMachine(SchedulerMachine):
    """The same runs with lazy store selection."""

    mode = StoreMode.LAZY


class WriteThroughMachine(SchedulerMachine):
    """The same runs with a CPU+disk cascade, write-through."""

    cascade = CascadeMode.WRITE_THROUGH


class WriteBackLazyMachine(SchedulerMachine):
    """The same runs with a CPU+disk cascade, write-back, lazy store selection."""

    mode = StoreMode.LAZY
    cascade = CascadeMode.WRITE_BACK


class WriteBackMachine(SchedulerMachine):
    """The same runs with a CPU+disk cascade, write-back, eager store selection."""

    cascade = CascadeMode.WRITE_BACK


STATEFUL_SETTINGS = settings(
    max_examples=1000,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CASCADE_SETTINGS = settings(STATEFUL_SETTINGS, max_examples=400)
SchedulerMachine.TestCase.settings = STATEFUL_SETTINGS
LazySchedulerMachine.TestCase.settings = STATEFUL_SETTINGS
WriteThroughMachine.TestCase.settings = CASCADE_SETTINGS
WriteBackMachine.TestCase.settings = CASCADE_SETTINGS
WriteBackLazyMachine.TestCase.settings = CASCADE_SETTINGS
test_eager_scheduler_runs_match_the_model = SchedulerMachine.TestCase
test_lazy_scheduler_runs_match_the_model = LazySchedulerMachine.TestCase
test_write_through_cascade_runs_match_the_model = WriteThroughMachine.TestCase
test_write_back_cascade_runs_match_the_model = WriteBackMachine.TestCase
test_write_back_lazy_cascade_runs_match_the_model = WriteBackLazyMachine.TestCase
