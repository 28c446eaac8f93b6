"""The random engine runs of the offload scheduler's stateful test (SPEC §6).

`SchedulerDriver` drives a `SimEngine` at random: arrivals from two prefix families
(some under the id of a request that finished: its load may still be in flight),
admissions taking all, none or part of their tier hit, chunked scheduling, preemption,
aborts (some after a failed forward: `computed=False`), requests skipping the prefix
cache, tokens counted computed ahead of the forward as output placeholders (async
scheduling), GPU cache eviction, scheduler resets, and 1-4 fake workers that complete,
delay, fail or re-report transfers, or report events never issued. The layout may add
a sliding window (blocks nulled as they leave it), a state group (stored from
hand-offs), both, or a scratch group to the full-attention group; the tiers run any
eviction and admission policy. On the way it records what the model checks in
`test_scheduler_stateful` need: lookup pins, queued loads, abandoned events and the
(tier, key) pairs a completed, kept copy holds.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import note
from hypothesis.stateful import rule
from scheduler_setup import (
    EXTRAS,
    FAMILIES,
    HASH_BLOCK,
    MAX_LIVE_REQUESTS,
    SEEDS,
    WORKER_ACTIONS,
    SchedulerSetup,
    Slot,
)
from sim import make_request, needed_positions

from kvtier.core.extra_keys import RequestExtras
from kvtier.core.kv_groups import GroupKind
from kvtier.offload.plan import Tier, TransferJob


class SchedulerDriver(SchedulerSetup):
    """Drive a `SimEngine` at random; subclasses add the checks and pick the store mode.

    There is one rule, `step`, so that no example is wasted on rules Hypothesis
    switched off (it disables rules at random per example).
    """

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
        self.admitted = False
        if not after_admission:
            self.incident(incident, rng)
        if rng.randrange(3) == 0:
            note("evict the GPU cache")
            engine.evict_gpu()
        for request_id in sorted(self.waiting):
            if rng.randrange(4):
                self.admit(request_id, rng)
        self.admitted = True
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
                # Async scheduling: the plan sees them computed. Not with a sliding window:
                # the scheduler's table keeps a dropped block's id, and once that block is
                # reused and hashed ahead the store reads it before the forward writes it
                # (harmless on a GPU, where stores wait for the forward; the fake worker
                # reads at submission).
                if rng.randrange(3) == 0 and self.group_id(GroupKind.SLIDING_WINDOW) is None:
                    note(f"{request_id} counts them computed, as output placeholders")
                    engine.count_ahead(request_id)
        self.preempt_scheduled(rng)
        self.offer_handoffs(rng)
        self.run_step()
        self.work(rng)
        self.drop_window_blocks(rng)
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
        skip = rng.randrange(10) == 0  # wants prompt logprobs: no prefix cache
        lora, extras = rng.choice(EXTRAS)
        request_id = self.new_request_id(rng)
        note(f"arrive {request_id}: {tokens} then {outputs}{' (skips the cache)' * skip}")
        if lora is not None or extras != RequestExtras():
            note(f"{request_id} has {lora} and {extras}")
        self.waiting[request_id] = make_request(
            request_id,
            tokens,
            HASH_BLOCK,
            outputs=outputs,
            lora=lora,
            extras=extras,
            skip_prefix_cache=skip,
        )

    def new_request_id(self, rng: random.Random) -> str:
        """Return a fresh request id, or sometimes (an engine whose ids repeat) the id of
        a request that finished."""
        live = set(self.live_ids())
        gone = [f"r{i}" for i in range(self.next_id) if f"r{i}" not in live]
        if gone and rng.randrange(8) == 0:
            return rng.choice(gone)
        self.next_id += 1
        return f"r{self.next_id - 1}"

    def admit(self, request_id: str, rng: random.Random) -> None:
        """Admit a waiting request, taking all, none or part of its tier hit.

        The tier and GPU references `lookup` and `on_allocated` add are recorded as the
        request's lookup pin or queued load, after checking they match the hit.
        """
        request = self.waiting[request_id]
        engine = self.engine
        old_pin = self.lookup_pins.pop(request_id, Counter())
        before = self.tier_refs()
        # Sometimes the engine caps the hit (`max_tokens`: a token budget left).
        max_tokens = rng.choice([None, None, None, rng.randrange(16)])
        found = engine.lookup(request, max_tokens)
        pin = self.tier_refs()
        pin.subtract(before)
        pin.update(old_pin)
        pin = +pin
        offered = found.num_offered_tokens
        if request.skip_prefix_cache:
            assert offered == 0, "a request skipping the cache got a hit"
            assert not pin, "a request skipping the cache left a pin"
        assert found.num_local_tokens + offered <= request.num_tokens - 1
        assert offered % HASH_BLOCK == 0
        assert max_tokens is None or offered <= max_tokens, "a hit over the cap"
        accepted = rng.choice(
            [offered, offered, 0, rng.randint(0, offered // self.block_size) * self.block_size]
        )
        note(f"admit {request_id}: {found.num_local_tokens} local + {accepted} of {offered}")
        tier_before, gpu_before = self.tier_refs(), self.gpu_refs()
        out_of_budget = rng.randrange(8) == 0  # the engine stops admitting after lookup
        if out_of_budget or engine.allocate(request, found, accepted) is None:
            if rng.randrange(3) == 0:
                note(f"{request_id} not allocated: the engine releases its lookup pin")
                engine.scheduler.release_lookup(request_id)
                assert self.tier_refs() == tier_before - pin, "release_lookup left a pin"
                return
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
        load_gpu.subtract(b for ids in engine.tables[request_id] for b in ids if b)
        assert all(n >= 0 for n in load_tier.values()), "on_allocated released a pin twice"
        load_tier, load_gpu = +load_tier, +load_gpu
        want_gpu = self.load_destinations(request_id, found.num_local_tokens, accepted)
        assert load_gpu == want_gpu, "a load writes other GPU blocks than the request reads"
        assert sum(load_tier.values()) == want_gpu.total()
        if accepted == offered or len(engine.layout.groups) == 1:
            assert not load_tier - pin, "a load reads a slot its lookup did not pin"
        if accepted:
            self.queued_loads[request_id] = (load_tier, load_gpu)

    def load_destinations(self, request_id: str, num_local: int, accepted: int) -> Counter[int]:
        """Return the GPU blocks a queued load must fill: those read after `accepted`.

        Empty when no load is queued (none accepted, or none could be: the load fails).
        """
        engine = self.engine
        if not any(item.request_id == request_id for item in engine.scheduler.loads.queued):
            return Counter()
        want: Counter[int] = Counter()
        for group_id in engine.layout.cacheable_group_ids:
            group = engine.layout.groups[group_id]
            first = num_local // group.block_size
            table = engine.tables[request_id][group_id]
            positions = needed_positions(group, num_local + accepted)
            want.update(table[pos] for pos in positions if pos >= first)
        return want

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
        if rng.randrange(16) == 0:
            note("report an event never issued")
            worker.report_unknown(max(worker.jobs, default=0) + 1000)
        for event_id in sorted(worker.in_flight):
            actions = self.worker_actions(worker.in_flight[event_id].job)
            for w in sorted(worker.in_flight[event_id].waiting):
                action = rng.choice(actions)
                if action != "wait":
                    note(f"worker {w}: event {event_id} {action}")
                if action == "done":
                    worker.complete(event_id, [w])
                elif action == "fail":
                    worker.fail(event_id, [w])
                elif action == "corrupt":
                    worker.corrupt_or_fail(event_id, w, rng)
        self.poll()

    def preempt_scheduled(self, rng: random.Random) -> None:
        """Preempt requests in the step that scheduled them (a subclass's engine may)."""

    def worker_actions(self, job: TransferJob) -> list[str]:
        """Return what a worker may do with `job` this step, one picked at random."""
        return WORKER_ACTIONS

    def offer_handoffs(self, rng: random.Random) -> None:
        """Hand off some computed state blocks of running requests (state layouts)."""
        engine = self.engine
        group_id = self.group_id(GroupKind.STATE)
        if group_id is None:
            return
        for request_id in sorted(engine.requests):
            request = engine.requests[request_id]  # blocks computed, not just scheduled
            num_full = (request.num_computed_tokens - request.num_output_placeholders) // HASH_BLOCK
            if engine.is_runnable(request_id) and num_full and rng.randrange(2):
                block_id = engine.tables[request_id][group_id][rng.randrange(num_full)]
                note(f"hand off state block {block_id} of {request_id}")
                engine.handoff(request_id, group_id, block_id)

    def drop_window_blocks(self, rng: random.Random) -> None:
        """Null blocks that left the sliding window of running requests (window layouts)."""
        engine = self.engine
        group_id = self.group_id(GroupKind.SLIDING_WINDOW)
        if group_id is None:
            return
        num_window_blocks = engine.layout.groups[group_id].num_window_blocks
        for request_id in sorted(engine.requests):
            if not engine.is_runnable(request_id) or rng.randrange(3):
                continue
            whole = engine.requests[request_id].num_computed_tokens // HASH_BLOCK
            table = engine.tables[request_id][group_id]
            gone = [p for p in range(whole - num_window_blocks) if table[p]]
            if gone:
                note(f"{request_id}: sliding window drops blocks {gone}")
                engine.drop_blocks(request_id, group_id, gone)

    def incident(self, incident: int, rng: random.Random) -> None:
        """Sometimes abort a request, reset the scheduler or report between steps."""
        if incident == 0 and self.live_ids():
            # Half of them abort a loading request when there is one (its load is rarely
            # in flight for long); a third come from a failed forward: `computed=False`.
            loading = sorted(self.engine.loading)
            victims = loading if loading and rng.randrange(2) else self.live_ids()
            self.abort(rng.choice(victims), rng.randrange(3) != 0, rng)
        elif incident == 1:
            self.reset()
        elif incident in (2, 3):
            self.work(rng)

    def abort(
        self, request_id: str, computed: bool = True, rng: random.Random | None = None
    ) -> None:
        """Finish a live request early, whatever it is doing (waiting, loading, running).

        With `rng`, a request aborted while loading is sometimes followed by a new one
        under its id (an engine whose ids repeat), while the first one's load is in flight.

        `computed=False` before this step's admissions: its part of the last forward pass
        failed, so the blocks it wrote hold no KV of their keys (`fail_forward`); no tier
        may ever take them for their keys (the model checks find the wrong bytes). After
        admissions a new request may already read them from the GPU cache: not this case.
        """
        note(f"abort {request_id}{'' if computed else ' (computed=False)'}")
        if not computed and not self.admitted and request_id in self.engine.requests:
            note(f"{request_id}'s last forward failed: {self.engine.last_forward.get(request_id)}")
            self.engine.fail_forward(request_id)
        request = self.waiting.pop(request_id, None)
        loading = (
            self.engine.requests.get(request_id) if request_id in self.engine.loading else None
        )
        self.engine.finish(request_id, request, computed=computed)
        self.lookup_pins.pop(request_id, None)
        self.queued_loads.pop(request_id, None)
        if loading is not None and rng is not None and rng.randrange(2):
            # An engine whose ids repeat: the same prompt again, its load still in flight.
            note(f"arrive {request_id} again: the same prompt")
            self.waiting[request_id] = make_request(
                request_id,
                loading.token_ids[: loading.num_prompt_tokens],
                HASH_BLOCK,
                lora=loading.lora,
                extras=loading.hasher.extras,
            )

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
        self.legit.clear()  # nothing from before is visible, even when it returned False
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
