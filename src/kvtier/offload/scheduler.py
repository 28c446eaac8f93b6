"""The offload scheduler: the scheduler-side manager of the lower tiers (SPEC §6).

Single-threaded and tensor-free. It owns the tiers' metadata (a `BlockPool` per tier,
used as its index), decides each step what to store and what to load, and turns worker
reports into visible keys and schedulable requests. The worker side sees only the
`TransferPlan` it builds and answers with `WorkerReport`s.

Pins, so nothing is evicted or reused under a transfer:

    lookup          tier blocks of the hit       until on_allocated (or the next lookup)
    on_allocated    used tier blocks + GPU dsts  until the load completes or fails
    store select    GPU src + fresh tier slot    until the store completes or fails
    demotion        CPU src + fresh disk slot    until the move completes or fails

With CPU and disk tiers both configured, GPU blocks are stored into the CPU tier, a
`Cascade` demotes CPU blocks to disk, and a lookup serves each block from the fastest
tier holding it; a request's load then has one part per tier (one job per tier).

This module wires the tier state and owns the requests' lifecycle (events, stats, gauges:
`scheduler_observability`); `PlanAssembler` builds plans, `TransferCompletion` applies reports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain

from kvtier.core.block_pool import BlockPool
from kvtier.core.longest_hit import HitGranularity
from kvtier.core.policies import PolicySpec
from kvtier.offload.completion import TransferCompletion
from kvtier.offload.config import OffloadConfig, StoreMode
from kvtier.offload.disk_slots import SetAsideSlots
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.lazy_walk import LazyWalk, lazy_target
from kvtier.offload.load_planner import LoadPlanner
from kvtier.offload.plan import SlotRecord, Tier, TransferPlan, WorkerReport
from kvtier.offload.plan_assembly import PlanAssembler
from kvtier.offload.preempted_stores import forget_last_step
from kvtier.offload.protocols import GpuPoolView, RequestView, StepInput
from kvtier.offload.registration import Registrar
from kvtier.offload.request_tags import RequestTags
from kvtier.offload.scheduler_checks import check_scheduler_invariants
from kvtier.offload.scheduler_observability import SchedulerObservability
from kvtier.offload.scheduler_setup import SchedulerSetup as SchedulerSetup
from kvtier.offload.scheduler_setup import make_cascade
from kvtier.offload.stats import StepCounters
from kvtier.offload.stats_taking import StatsTaker, info_labels
from kvtier.offload.store_selection import StoreSelector
from kvtier.offload.tier_index import TierIndex
from kvtier.offload.tier_reset import TierReset
from kvtier.offload.transfers import ReportOutcome, TransferBook
from kvtier.offload.unconfirmed_finish import hold_back_unconfirmed


class OffloadScheduler(SchedulerObservability):
    """Plan stores and loads between the engine's GPU pool and the lower tiers (its
    events, stats and gauges: `SchedulerObservability`)."""

    def __init__(self, config: OffloadConfig, setup: SchedulerSetup) -> None:
        if setup.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {setup.num_workers}")
        if config.fine_grained_hits and not setup.layout.supports_fine_grained_hits:
            raise ValueError("fine_grained_hits=True, but the KV layout cannot use them")
        if setup.bytes_per_slot < 0:
            raise ValueError(f"bytes_per_slot must be >= 0, got {setup.bytes_per_slot}")
        self.config = config
        self.layout = setup.layout
        self.bytes_per_slot = setup.bytes_per_slot or setup.layout.bytes_per_block
        self.tier = config.tier
        policy = PolicySpec(config.eviction_policy, config.admission_policy)
        self._eviction = policy.make_eviction(setup.num_tier_blocks)
        self._admission = policy.make_admission(setup.num_tier_blocks)
        self.tier_pool = BlockPool(
            setup.num_tier_blocks,
            free_queue=self._eviction,
            medium=self.tier.value,
            record_events=config.events,
        )
        self.registrar = Registrar(
            self.layout, self.tier, self.tier_pool, config.events, config.token_check
        )
        pools = [(self.tier, self.tier_pool)]
        # Disk copies dropped or not registered: their manifest records go with the next
        # plan (`TransferPlan.forget_slots`); an engine shutting down takes the rest.
        self.dropped_slots = DroppedSlots(config.disk_persist)
        # A disk-only tier's slots of failed stores (a cascade's demotions have their own).
        self._store_set_aside = SetAsideSlots(self.tier_pool) if self.tier is Tier.DISK else None
        self.cascade = make_cascade(
            config,
            setup,
            policy,
            self.tier_pool,
            lambda key, num_tokens: self.registrar.event(key, num_tokens, Tier.DISK),
            self.dropped_slots,
        )
        if self.cascade is not None:
            pools.append((Tier.DISK, self.cascade.disk_pool))
        self.index = TierIndex(pools)
        self._gpu_pool = setup.gpu_pool
        self._granularity = (
            HitGranularity.HASH_BLOCK
            if config.fine_grained_hits
            else HitGranularity.SCHEDULER_BLOCK
        )
        self._counters = StepCounters()
        self._selector: StoreSelector | None = None
        self._book = TransferBook(setup.num_workers)
        self.tags = RequestTags(self.layout) if config.token_check else None
        self.loads = LoadPlanner(
            self.layout,
            self.index,
            self._granularity,
            self._book,
            self.tags,
            recompute_ahead=setup.queue_by_priority,
            eagle_proof=setup.eagle_drafter,
        )
        self._plans = PlanAssembler(
            config,
            self.registrar,
            self.index,
            self.loads,
            self._book,
            self.cascade,
            lazy_target(self.layout, config.max_batched_tokens),
            self.dropped_slots,
            keep_written=setup.preempts_scheduled,
        )
        self._completion = TransferCompletion(
            self.tier_pool,
            self.index,
            self.registrar,
            self._book,
            self._counters,
            self.cascade,
            lazy=config.store_mode is StoreMode.LAZY,
            hit_tokens=self.loads.hit_tokens,
            dropped=self.dropped_slots,
        )
        self._reset = TierReset(self.index, self._book, self.loads, self.cascade, self.tags)
        self._stats = StatsTaker(
            self._counters,
            self.loads,
            self._completion,
            self.cascade,
            tuple(tier.value for tier in self.index.tiers),
            self.bytes_per_slot,
            info_labels(config, self.tier, self.tier_pool.num_blocks, self.cascade),
        )
        if setup.gpu_pool is not None:
            self.bind_gpu_pool(setup.gpu_pool)

    def bind_gpu_pool(self, gpu_pool: GpuPoolView) -> None:
        """Attach the engine's GPU pool (once, before the first lookup)."""
        self._gpu_pool = gpu_pool
        self.loads.gpu_pool = gpu_pool
        self._selector = StoreSelector(
            layout=self.layout,
            gpu_pool=gpu_pool,
            tier_pool=self.tier_pool,
            counters=self._counters,
            record_payload=self.config.events and self.config.store_mode is StoreMode.EAGER,
            fine_grained=self.config.fine_grained_hits,
            lazy=LazyWalk(record_loras=self.config.events),  # read in lazy mode only
            admission=self._admission,
            tags=self.tags,
            set_aside=self._store_set_aside,
            # The token check on a disk-only tier: a tagged store replaces an untagged copy.
            replaced=self.dropped_slots
            if self.tier is Tier.DISK and self.config.token_check
            else None,
        )
        self._completion.selector = self._selector

    @property
    def selector(self) -> StoreSelector:
        """Return the store selector; raises when no GPU pool is bound yet."""
        if self._selector is None:
            raise RuntimeError("no GPU pool bound: call bind_gpu_pool() first")
        return self._selector

    @property
    def gpu_pool(self) -> GpuPoolView:
        """Return the bound GPU pool."""
        return self.selector.gpu_pool

    # ------------------------------------------------------------------ lookup

    def lookup(
        self, request: RequestView, num_local_tokens: int, max_tokens: int | None = None
    ) -> int:
        """Return how many tokens past the local prefix the tiers can serve, and pin them.

        `max_tokens` caps the hit (the longest servable hit of at most that many tokens).
        """
        if self._selector is not None:
            self._selector.across_reset.discard(request.request_id)  # admitted afresh
        return self.loads.lookup(request, num_local_tokens, max_tokens)

    def release_lookup(self, request_id: str) -> None:
        """Drop the tier blocks the request's last lookup pinned (an engine declining it)."""
        self.loads.release_pin(request_id)

    def offer(self, request_id: str, num_tokens: int) -> int | None:
        """Return what to offer for the `num_tokens` hit the request's lookup just found:
        the hit; or, while requests wait to recompute after a failed load, 0 (recompute) or
        None (ask again later), its pin released (`LoadPlanner` says which)."""
        return self.loads.offer(request_id, num_tokens)

    def on_allocated(
        self,
        request: RequestView,
        block_ids_per_group: Sequence[Sequence[int]],
        num_external_tokens: int,
        scheduled: bool = False,
    ) -> dict[Tier, int]:
        """Queue the load of `num_external_tokens` accepted tokens into the request's blocks.

        `block_ids_per_group` is the request's whole GPU block table per group. If the
        load cannot be queued, the next `apply_report` returns it as a failed load.
        Returns how many of the tokens each tier serves (empty when none is loaded).

        `scheduled`: the next plan schedules the request with this whole table (vLLM runs
        a request allocated without external tokens in the step that allocated it). Lazy
        mode then notes its blocks in use in that plan only: only the plan's walk reads it.
        """
        # `selector` and empty calls skipped: called once per request between engine
        # steps, it runs cold, where every Python call costs ~0.5-1 µs.
        selector = self._selector if self._selector is not None else self.selector
        if self.config.store_mode is StoreMode.EAGER:
            selector.track(request.request_id)
        elif not scheduled:
            selector.lazy.note_allocated(block_ids_per_group, selector.gpu_pool, request)
        if selector.loaded.by_block:
            selector.loaded.note_in_use(request.request_id, block_ids_per_group)
        return self.loads.on_allocated(request, block_ids_per_group, num_external_tokens)

    def holds_load(self, request_id: str, block_ids_per_group: Sequence[Sequence[int]]) -> bool:
        """Return True when `on_allocated` for these block tables (the engine's very list)
        queued the load or its failure: the load's outcome comes in a later report. False
        when an interrupt cut the call short before: nothing of that load is queued."""
        return self.loads.holds_load(request_id, block_ids_per_group)

    # ------------------------------------------------------------------ plan

    def build_plan(self, step: StepInput) -> TransferPlan:
        """Select this step's stores; issue them as one event, the queued loads as one per tier.

        Request views must not yet count this step's scheduled tokens as computed.
        """
        self.loads.end_pass()  # the engine's pass over its queue ends with the plan
        return self._plans.build(step, self.selector, walk=not self._reset.pending)

    # ------------------------------------------------------------------ report

    def apply_report(self, report: WorkerReport) -> ReportOutcome:
        """Apply worker completions: register stored keys, release pins, finish loads.

        A request whose load failed is offered no hit until the engine allocates it
        again: it recomputes (SPEC §6.8), even where another copy of its blocks exists.
        A call cut short (KeyboardInterrupt) may be repeated with the same report: the
        next call applies what it left and returns the loads it did not return.
        """
        outcome = self._completion.apply(report)
        self.loads.note_failed(failed.request_id for failed in outcome.failed_loads)
        if outcome.failed_loads and self._selector is not None:
            forget_last_step(self._selector, (failed.request_id for failed in outcome.failed_loads))
        self._reset.note_report()
        self._completion.outcome_taken()  # last: a call cut short returns it again
        return outcome

    def is_in_flight(self, event_id: int) -> bool:
        """Return True while an issued event awaits a report from some worker (or the
        caller's apply of its completion)."""
        return event_id in self._book

    def has_unissued_failures(self) -> bool:
        """Return True when the next `apply_report` returns loads dropped before issue.

        An engine that drains them with an empty report each step can skip the call
        while this is False (nothing else changes without a report).
        """
        return self._book.has_unissued_failures()

    # ------------------------------------------------------------------ lifecycle

    def on_finished(
        self,
        request: RequestView,
        block_ids_per_group: Sequence[Sequence[int]],
        *,
        computed: bool = True,
    ) -> bool:
        """Queue the request's remaining confirmed blocks for storing and drop its state;
        return True when it drops a load of the request never issued (no report names it).

        `computed=False`: the engine cannot vouch that the compute it counts in
        `num_computed_tokens` ran (a forward pass failed and the engine finishes the
        request from its fault handler): its blocks may hold another prefix's KV, so
        none is queued here. Blocks selected in earlier plans were confirmed by then.
        Its blocks are held back and lose their keys in the engine's pool
        (`unconfirmed_finish`; `unconfirm_finished` for a finish the engine learns later).

        Never delays the engine freeing its GPU blocks: selected blocks are pinned here.
        Issued transfers keep their pins until the workers report them; an issued load's
        outcome is then returned to no one (a new request may have taken the id).
        """
        request_id = request.request_id
        # Blocks a load has not filled yet hold no valid KV: store nothing of this request.
        dropped = self.loads.drop_request(request_id)
        loading = self._book.drop_outcomes(request_id) or dropped
        selector = self._selector if self._selector is not None else self.selector  # (hot)
        state = selector.tracked.get(request_id)
        if state is not None and not loading and computed:
            state.block_ids = [list(ids) for ids in block_ids_per_group]
            selector.select_request(request, state, final=True)
            if self.config.fine_grained_hits:
                selector.select_partial_tail(request, state)
        if not computed:
            hold_back_unconfirmed(selector, self.config.store_mode, request, block_ids_per_group)
        elif (lazy := selector.lazy).record_loras and self.config.store_mode is StoreMode.LAZY:
            lazy.note_finished(self.layout, request, block_ids_per_group, selector.gpu_pool)
        selector.untrack(request_id)
        selector.across_reset.discard(request_id)
        self._plans.forget(request_id)
        if self.tags is not None:
            self.tags.drop(request_id)
        return dropped

    def unconfirm_finished(
        self, request: RequestView, block_ids_per_group: Sequence[Sequence[int]]
    ) -> None:
        """Take an earlier `on_finished` of `request` as `computed=False` (learned since)."""
        mode, groups = self.config.store_mode, block_ids_per_group
        hold_back_unconfirmed(self.selector, mode, request, groups, finished_earlier=True)

    def has_pending_stores(self) -> bool:
        """Return True while any store or demotion is queued, in flight or abandoned.

        Write-back demotions too: an engine keeps stepping until their reports arrive (an
        idle vLLM would otherwise hold their slots, and fail a reset, until its next
        request). A failed one is not retried (`Cascade.failed`), so this ends. Write-through
        retries (`Cascade.retry`) are not pending until issued, and are bounded.
        """
        queued_moves = self.cascade is not None and bool(self.cascade.queued)
        return bool(self.selector.queued) or queued_moves or self._book.has_stores()

    def holds_gpu_blocks_alone(self) -> bool:
        """Return True when queued or issued transfers hold every reference on a GPU
        block: the block goes back to the GPU pool once they are reported (vLLM's
        `has_pending_block_frees`: wait for it rather than preempt a request).

        A block may carry more than one transfer's pin: a store a reset abandoned keeps
        its pin, and the same block's key may be stored afresh meanwhile. Walks every
        pinned block: for when an allocation failed, not for each step."""
        pool = self.gpu_pool
        queued_loads = (b for item in self.loads.queued for b in item.gpu_block_ids)
        pinned = chain(self.selector.queued.gpu_block_ids, queued_loads)
        pins = Counter(chain(pinned, self._book.pinned_gpu_blocks()))
        return any(pool.block(b).ref_count == n for b, n in pins.items())

    @property
    def persistence_ended(self) -> bool:
        """Return True once a reset ended a persistent disk tier's persistence."""
        return self._plans.persistence_ended

    def reset(self) -> bool:
        """Drop all tier contents; return False while issued transfers are outstanding.

        No lookup finds anything stored before the call either way; while the reset
        waits, lazy walks and write-back demotions pause (see `tier_reset`). With
        `disk_persist`, every later plan ends the disk tier's persistence
        (`TransferPlan.end_persistence`), whichever the return value: the workers drop
        every manifest record and record nothing more in this run.
        """
        if self.config.disk_persist:
            self._plans.persistence_ended = True
            self.dropped_slots.stop()  # every record is dropped
        return self._reset.reset(self.selector)

    def restore(self, tier: Tier, slots: Iterable[tuple[int, SlotRecord]]) -> int:
        """Index what a persistent tier kept from an earlier run; return the blocks indexed.

        Call once, before the first lookup. A slot out of range, or a key of a group
        that is not cached, is skipped with a warning.
        """
        pool = self.index.pools.get(tier)
        if pool is None:
            raise ValueError(f"tier {tier.value} is not configured")
        dropped: list[int] = []  # untagged duplicates the token check never serves
        num_restored = self.registrar.restore(tier, pool, slots, dropped)
        if tier is Tier.DISK:
            self.dropped_slots.add(dropped)
        return num_restored

    def check_invariants(self) -> None:
        """Raise AssertionError when pins, in-flight keys or pools disagree."""
        check_scheduler_invariants(self)
