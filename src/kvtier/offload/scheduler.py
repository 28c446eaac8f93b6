"""The offload scheduler: the scheduler-side manager of one lower tier (SPEC §6).

Single-threaded and tensor-free. It owns the tier's metadata (a `BlockPool` used as the
tier index), decides each step what to store and what to load, and turns worker reports
into visible keys and schedulable requests. The worker side sees only the
`TransferPlan` it builds and answers with `WorkerReport`s.

Pins, so nothing is evicted or reused under a transfer:

    lookup          tier blocks of the hit       until on_allocated (or the next lookup)
    on_allocated    used tier blocks + GPU dsts  until the load completes or fails
    store select    GPU src + fresh tier slot    until the store completes or fails
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.events import BlockStored, KVEvent
from kvtier.core.keys import Key, key_block_hash, key_group_id
from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import HitGranularity, LongestHit, find_longest_hit
from kvtier.core.policies import PolicySpec
from kvtier.offload.config import OffloadConfig, StoreMode
from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport
from kvtier.offload.protocols import GpuPoolView, RequestView, StepInput, TableUpdate
from kvtier.offload.stats import OffloadStats, StepCounters
from kvtier.offload.store_selection import StoreItem, StoreSelector, lazy_target
from kvtier.offload.transfers import (
    FailedLoad,
    IssuedTransfer,
    LoadItem,
    ReportOutcome,
    TransferBook,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _LookupPin:
    """A lookup's hit, pinned until `on_allocated` consumes or releases it."""

    num_local_tokens: int
    hit: LongestHit
    pinned: list[int]


@dataclass(frozen=True)
class SchedulerSetup:
    """What the offload scheduler is built from, besides its config."""

    layout: KVLayout
    num_tier_blocks: int
    num_workers: int = 1
    gpu_pool: GpuPoolView | None = None


@dataclass(slots=True)
class _Totals:
    hit_tokens: int = 0
    warned_misaligned: bool = False
    events: list[KVEvent] = field(default_factory=list)


class OffloadScheduler:
    """Plan stores and loads between the engine's GPU pool and one lower tier."""

    def __init__(self, config: OffloadConfig, setup: SchedulerSetup) -> None:
        if setup.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {setup.num_workers}")
        if config.fine_grained_hits and not setup.layout.supports_fine_grained_hits:
            raise ValueError("fine_grained_hits=True, but the KV layout cannot use them")
        self.config = config
        self.layout = setup.layout
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
        self._gpu_pool = setup.gpu_pool
        self._granularity = (
            HitGranularity.HASH_BLOCK
            if config.fine_grained_hits
            else HitGranularity.SCHEDULER_BLOCK
        )
        self._counters = StepCounters()
        self._selector: StoreSelector | None = None
        self._book = TransferBook(setup.num_workers)
        self._pins: dict[str, _LookupPin] = {}
        self._queued_loads: list[LoadItem] = []
        self._totals = _Totals()
        self._next_step_id = 0
        self._lazy_target = lazy_target(self.layout, config.max_batched_tokens)
        if setup.gpu_pool is not None:
            self.bind_gpu_pool(setup.gpu_pool)

    def bind_gpu_pool(self, gpu_pool: GpuPoolView) -> None:
        """Attach the engine's GPU pool (once, before the first lookup)."""
        self._gpu_pool = gpu_pool
        self._selector = StoreSelector(
            layout=self.layout,
            gpu_pool=gpu_pool,
            tier_pool=self.tier_pool,
            counters=self._counters,
            record_payload=self.config.events and self.config.store_mode is StoreMode.EAGER,
            fine_grained=self.config.fine_grained_hits,
            admission=self._admission,
        )

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

    def lookup(self, request: RequestView, num_local_tokens: int) -> int:
        """Return how many tokens past the local prefix the tier can serve, and pin them."""
        self._release_pin(request.request_id)
        if request.skip_prefix_cache:
            return 0
        if num_local_tokens % self.layout.scheduler_block_size:
            if not self._totals.warned_misaligned:
                logger.warning(
                    "local prefix of %d tokens is not a multiple of the scheduler block (%d): "
                    "no external hit (warned once)",
                    num_local_tokens,
                    self.layout.scheduler_block_size,
                )
                self._totals.warned_misaligned = True
            return 0
        hashes = request.block_hashes[num_local_tokens // self.layout.hash_block_size :]
        max_tokens = request.num_tokens - 1 - num_local_tokens  # the last token is recomputed
        if not hashes or max_tokens <= 0:
            return 0
        hit = find_longest_hit(
            self.layout, hashes, max_tokens, self.tier_pool.cached_block, self._granularity
        )
        if hit.num_tokens == 0:
            return 0
        pinned = [b for ids in hit.block_ids for b in ids if b != NULL_BLOCK_ID]
        self.tier_pool.touch(pinned)
        self._pins[request.request_id] = _LookupPin(num_local_tokens, hit, pinned)
        return hit.num_tokens

    def on_allocated(
        self,
        request: RequestView,
        block_ids_per_group: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Queue the load of `num_external_tokens` accepted tokens into the request's blocks.

        `block_ids_per_group` is the request's whole GPU block table per group. If the
        load cannot be queued, the next `apply_report` returns it as a failed load.
        """
        if self.config.store_mode is StoreMode.EAGER:
            self.selector.track(request.request_id)
        pin = self._pins.pop(request.request_id, None)
        if num_external_tokens == 0:
            if pin is not None:
                logger.warning("request %s accepted 0 of its tier hit", request.request_id)
                self.tier_pool.free(pin.pinned)
            return
        start = pin.num_local_tokens if pin is not None else request.num_computed_tokens
        end = start + num_external_tokens
        if pin is None or num_external_tokens > pin.hit.num_tokens:
            logger.warning(
                "request %s: %d external tokens without a matching lookup pin; not loading",
                request.request_id,
                num_external_tokens,
            )
            if pin is not None:
                self.tier_pool.free(pin.pinned)
            self._book.fail_unissued(FailedLoad(request.request_id, start, end))
            return
        if num_external_tokens % self.layout.hash_block_size:
            self.tier_pool.free(pin.pinned)
            raise ValueError(
                f"num_external_tokens={num_external_tokens} is not a multiple of the hash "
                f"block ({self.layout.hash_block_size})"
            )
        tier_ids, gpu_ids = self._pair_load(pin, block_ids_per_group, num_external_tokens)
        self.tier_pool.touch(tier_ids)
        self.gpu_pool.touch(gpu_ids)
        self.tier_pool.free(pin.pinned)
        self._queued_loads.append(LoadItem(request.request_id, tier_ids, gpu_ids, start, end))
        self._totals.hit_tokens += num_external_tokens

    def _pair_load(
        self, pin: _LookupPin, block_ids_per_group: Sequence[Sequence[int]], num_tokens: int
    ) -> tuple[list[int], list[int]]:
        tier_ids: list[int] = []
        gpu_ids: list[int] = []
        for group_id in self.layout.cacheable_group_ids:
            block_size = self.layout.groups[group_id].block_size
            first = pin.num_local_tokens // block_size
            table = block_ids_per_group[group_id]
            num_blocks = -(-num_tokens // block_size)
            for i, tier_block in enumerate(pin.hit.block_ids[group_id][:num_blocks]):
                if tier_block == NULL_BLOCK_ID:
                    continue
                gpu_block = table[first + i]
                if gpu_block == NULL_BLOCK_ID:
                    raise ValueError(f"group {group_id}: load destination {first + i} is null")
                tier_ids.append(tier_block)
                gpu_ids.append(gpu_block)
        return tier_ids, gpu_ids

    def _release_pin(self, request_id: str) -> None:
        pin = self._pins.pop(request_id, None)
        if pin is not None:
            self.tier_pool.free(pin.pinned)

    # ------------------------------------------------------------------ plan

    def build_plan(self, step: StepInput) -> TransferPlan:
        """Select this step's stores, issue them and every queued load as one event each.

        Request views must not yet count this step's scheduled tokens as computed.
        """
        selector = self.selector
        for request_id in step.preempted_request_ids:
            selector.reset_request(request_id)
        eager = self.config.store_mode is StoreMode.EAGER
        if eager:
            for scheduled in step.scheduled:
                resumed = scheduled.table_update is TableUpdate.REPLACE
                if scheduled.request.request_id in step.preempted_request_ids and not resumed:
                    continue
                state = selector.update_table(scheduled)
                if state is not None:
                    selector.select_request(scheduled.request, state)
        gone = step.finished_request_ids | step.preempted_request_ids
        selector.select_handoffs(step.handoffs, gone, require_tracked=eager)
        if not eager:
            selector.select_lazy(self._lazy_target)
        jobs = []
        stores = selector.take_queued()
        if stores:
            job = TransferJob(
                self._book.next_event_id(),
                Tier.GPU,
                self.tier,
                tuple(item.gpu_block_id for item in stores),
                tuple(item.tier_block_id for item in stores),
            )
            self._book.issue(IssuedTransfer(job, stores=stores))
            jobs.append(job)
        if self._queued_loads:
            loads, self._queued_loads = self._queued_loads, []
            job = TransferJob(
                self._book.next_event_id(),
                self.tier,
                Tier.GPU,
                tuple(b for item in loads for b in item.tier_block_ids),
                tuple(b for item in loads for b in item.gpu_block_ids),
            )
            self._book.issue(IssuedTransfer(job, loads=loads))
            jobs.append(job)
        self._next_step_id += 1
        return TransferPlan(
            step_id=self._next_step_id,
            jobs=tuple(jobs),
            load_request_ids=self._book.load_request_ids(),
            need_flush=bool(step.preempted_request_ids),
        )

    # ------------------------------------------------------------------ report

    def apply_report(self, report: WorkerReport) -> ReportOutcome:
        """Apply worker completions: register stored keys, release pins, finish loads."""
        finished: list[str] = []
        failed = self._book.take_unissued_failures()
        for transfer in self._book.complete(report):
            for load in transfer.loads:
                # Tail first (SPEC §4), so a prefix's tail is evicted before its root.
                self.tier_pool.free(load.tier_block_ids[::-1])
                self.gpu_pool.free(load.gpu_block_ids[::-1])
                if transfer.succeeded:
                    finished.append(load.request_id)
                    self._counters.num_loaded_blocks += len(load.tier_block_ids)
                else:
                    failed.append(FailedLoad(load.request_id, load.start_token, load.end_token))
                    self._counters.num_failed_loads += 1
                    for block_id in load.tier_block_ids:  # never serve a suspect copy again
                        self.tier_pool.discard_keys(block_id)
            if transfer.stores:
                self._complete_stores(transfer)
        return ReportOutcome(tuple(finished), tuple(failed))

    def _complete_stores(self, transfer: IssuedTransfer) -> None:
        if not transfer.succeeded or transfer.abandoned:
            if not transfer.succeeded:
                self._counters.num_failed_stores += len(transfer.stores)
            self.selector.release(transfer.stores)
            return
        for item in transfer.stores:
            self._register(item)
            self.selector.in_flight_keys.discard(item.key)
        self._counters.num_stored_blocks += len(transfer.stores)
        # Tail first (SPEC §4): these pins may be the blocks' last references.
        stores = transfer.stores[::-1]
        self.gpu_pool.free([item.gpu_block_id for item in stores])
        self.tier_pool.free([item.tier_block_id for item in stores])

    def _register(self, item: StoreItem) -> None:
        tier_block = item.tier_block_id
        if item.is_partial_tail:
            event = self._event(item.key, item.tail_num_tokens)
            self.tier_pool.insert_key(item.key, tier_block, item.tail_num_tokens, event)
            return
        gpu_pool = self.gpu_pool
        gpu_block_id = item.gpu_block_id
        key = gpu_pool.key(gpu_block_id)
        if key is None:
            key = item.key
        num_tokens = gpu_pool.num_tokens(gpu_block_id)
        if not num_tokens:
            num_tokens = self.layout.groups[key_group_id(key)].block_size
        if not self.config.events:
            self.tier_pool.insert_key(key, tier_block, num_tokens)
            for secondary in gpu_pool.secondary_keys(gpu_block_id):
                self.tier_pool.insert_key(secondary, tier_block, num_tokens)
            return
        stored = item.stored
        if stored is not None and stored.block_hash == key_block_hash(key):
            event = replace(stored, medium=self.tier.value)
        else:
            event = self._event(key, num_tokens)
        self.tier_pool.insert_key(key, tier_block, num_tokens, event)
        for secondary in gpu_pool.secondary_keys(gpu_block_id):
            event = self._event(secondary, num_tokens)
            self.tier_pool.insert_key(secondary, tier_block, num_tokens, event)

    def _event(self, key: Key, num_tokens: int) -> BlockStored:
        """Return the payload-free `BlockStored` of `key`, with its group's kind and window."""
        group_id = key_group_id(key)
        group = self.layout.groups[group_id]
        return BlockStored(
            key_block_hash(key),
            group_id,
            num_tokens,
            medium=self.tier.value,
            group_kind=group.kind.value,
            sliding_window=group.sliding_window,
        )

    # ------------------------------------------------------------------ lifecycle

    def on_finished(
        self, request: RequestView, block_ids_per_group: Sequence[Sequence[int]]
    ) -> None:
        """Queue the request's remaining confirmed blocks for storing and drop its state.

        Never delays the engine freeing its GPU blocks: selected blocks are pinned here.
        Issued transfers keep their pins until the workers report them.
        """
        request_id = request.request_id
        self._release_pin(request_id)
        # Blocks a load has not filled yet hold no valid KV: store nothing of this request.
        loading = any(load.request_id == request_id for load in self._queued_loads) or any(
            load.request_id == request_id for transfer in self._book for load in transfer.loads
        )
        keep = []
        for load in self._queued_loads:
            if load.request_id == request_id:
                self.tier_pool.free(load.tier_block_ids)
                self.gpu_pool.free(load.gpu_block_ids)
            else:
                keep.append(load)
        self._queued_loads = keep
        selector = self.selector
        state = selector.tracked.get(request_id)
        if state is not None and not loading:
            state.block_ids = [list(ids) for ids in block_ids_per_group]
            selector.select_request(request, state)
            if self.config.fine_grained_hits:
                selector.select_partial_tail(request, state)
        selector.untrack(request_id)

    def has_pending_stores(self) -> bool:
        """Return True while any store is queued, in flight or abandoned."""
        return bool(self.selector.queued) or self._book.has_stores()

    def reset(self) -> bool:
        """Drop all tier contents; return False while issued transfers are outstanding.

        Never-issued transfers are dropped at once (their loads come back as failed
        loads in the next report); issued stores are abandoned and never become visible.
        """
        for request_id in list(self._pins):
            self._release_pin(request_id)
        for load in self._queued_loads:
            self.tier_pool.free(load.tier_block_ids)
            self.gpu_pool.free(load.gpu_block_ids)
            self._book.fail_unissued(FailedLoad(load.request_id, load.start_token, load.end_token))
        self._queued_loads = []
        selector = self.selector
        selector.release(selector.take_queued())
        selector.tracked.clear()
        selector.lazy_cursor = None
        self._book.abandon_stores()
        if len(self._book):
            return False
        cleared = self.tier_pool.reset()
        assert cleared, "tier blocks referenced with no transfer outstanding"
        return True

    # ------------------------------------------------------------------ observability

    def take_events(self) -> list[KVEvent]:
        """Return and forget the tier's events (medium = the tier), oldest first."""
        return self.tier_pool.take_events()

    def take_stats(self) -> OffloadStats:
        """Return this step's counters (then reset them), the gauges and the totals."""
        counters = self._counters
        bytes_per_block = self.layout.bytes_per_block
        pending = len(self.selector.queued) + sum(len(t.stores) for t in self._book)
        stats = OffloadStats(
            store_outcomes=dict(counters.store_outcomes),
            handoff_outcomes=dict(counters.handoff_outcomes),
            num_loaded_blocks=counters.num_loaded_blocks,
            num_stored_blocks=counters.num_stored_blocks,
            num_failed_loads=counters.num_failed_loads,
            num_failed_stores=counters.num_failed_stores,
            num_bytes_loaded=counters.num_loaded_blocks * bytes_per_block,
            num_bytes_stored=counters.num_stored_blocks * bytes_per_block,
            num_tier_blocks_in_use=self.tier_pool.num_usable_blocks - self.tier_pool.num_free(),
            num_blocks_pending_store=pending,
            hit_tokens={self.tier.value: self._totals.hit_tokens},
            info={
                "tier": self.tier.value,
                "store_mode": self.config.store_mode.value,
                "num_tier_blocks": str(self.tier_pool.num_blocks),
                "disk_io_mode": self.config.disk_io_mode.value,
            },
        )
        counters.clear()
        return stats

    def check_invariants(self) -> None:
        """Raise AssertionError when pins, in-flight keys or pools disagree."""
        self.tier_pool.check_invariants()
        self._eviction.check_invariants()
        self._admission.check_invariants()
        tier_refs: Counter[int] = Counter()
        gpu_refs: Counter[int] = Counter()
        for pin in self._pins.values():
            tier_refs.update(pin.pinned)
        loads = list(self._queued_loads)
        stores = list(self.selector.queued)
        for transfer in self._book:
            loads.extend(transfer.loads)
            stores.extend(transfer.stores)
        for load in loads:
            tier_refs.update(load.tier_block_ids)
            gpu_refs.update(load.gpu_block_ids)
        for item in stores:
            tier_refs[item.tier_block_id] += 1
            gpu_refs[item.gpu_block_id] += 1
        for block_id in range(1, self.tier_pool.num_blocks):
            assert self.tier_pool.ref_count(block_id) == tier_refs[block_id], (
                f"tier block {block_id}: ref {self.tier_pool.ref_count(block_id)}, "
                f"pins {tier_refs[block_id]}"
            )
        for block_id, count in gpu_refs.items():
            assert self.gpu_pool.block(block_id).ref_count >= count, f"GPU block {block_id}"
        assert self.selector.in_flight_keys == {item.key for item in stores}, "in-flight keys"
