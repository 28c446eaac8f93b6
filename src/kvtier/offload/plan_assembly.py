"""Assembly of each step's `TransferPlan`: the step's stores, loads and demotions as jobs.

`PlanAssembler` runs the step's store selection (preemptions, eager table updates,
hand-offs, lazy stores), then issues one `TransferJob` (one event) for the queued
stores, one per tier for the queued loads and one for the cascade's demotions, each
recorded in the `TransferBook` until every worker reported it.
"""

from __future__ import annotations

from itertools import chain

from kvtier.offload.cascade import Cascade, MoveItem
from kvtier.offload.config import OffloadConfig, StoreMode
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.lazy_walk import held_hits, unwritten_blocks
from kvtier.offload.load_planner import LoadPlanner
from kvtier.offload.plan import SlotRecord, Tier, TransferJob, TransferPlan
from kvtier.offload.preempted_stores import select_preempted
from kvtier.offload.protocols import GpuPoolView, RequestView, StepInput
from kvtier.offload.registration import Registrar
from kvtier.offload.store_batch import StoreBatch
from kvtier.offload.store_selection import StoreSelector
from kvtier.offload.tier_index import TierIndex
from kvtier.offload.transfers import IssuedTransfer, LoadItem, TransferBook


class PlanAssembler:
    """Build and issue each step's plan; `lazy_target` is lazy mode's per-step visit count.

    `keep_written`: keep where each request's last scheduled step ends, for an engine that
    may preempt a request it scheduled earlier in the same step (`_hold_back_unwritten`).
    """

    def __init__(
        self,
        config: OffloadConfig,
        registrar: Registrar,
        index: TierIndex,
        loads: LoadPlanner,
        book: TransferBook,
        cascade: Cascade | None,
        lazy_target: int,
        dropped: DroppedSlots | None = None,
        keep_written: bool = False,
    ) -> None:
        self._config = config
        self._tier = config.tier
        self._registrar = registrar
        self._index = index
        self._loads = loads
        self._book = book
        self._cascade = cascade
        self._lazy_target = lazy_target
        self._dropped = dropped
        self._next_step_id = 0
        # A reset ended a persistent disk tier's persistence: every later plan says so.
        self.persistence_ended = False
        # With `keep_written`: request id -> (its view, the tokens its last scheduled step
        # writes through, counted from its confirmed tokens: an engine may count a step's
        # tokens computed ahead of its forward), for the requests scheduled since their
        # admission (`_hold_back_unwritten`); a finished one's goes with `forget`.
        self._written: dict[str, tuple[RequestView, int]] | None = {} if keep_written else None

    def build(self, step: StepInput, selector: StoreSelector, walk: bool = True) -> TransferPlan:
        """Select this step's stores; issue them as one event, the queued loads as one per tier.

        `walk` False (a reset waits): no lazy walk, no write-back demotion and no
        write-through retry.
        """
        eager = self._config.store_mode is StoreMode.EAGER
        written = self._written
        for request_id in step.preempted_request_ids:
            last = None if written is None else written.pop(request_id, None)
            if last is not None:
                self._hold_back_unwritten(selector, *last)
            if eager and not self._loading(request_id):  # before its table goes
                select_preempted(selector, request_id)
            selector.reset_request(request_id)
        if written is not None:
            for scheduled in step.scheduled:  # from its confirmed tokens, as `written_end`
                request = scheduled.request
                confirmed = request.num_computed_tokens - request.num_output_placeholders
                written[request.request_id] = (request, confirmed + scheduled.num_scheduled_tokens)
        if eager:
            selector.select_scheduled(step.scheduled)
        gone = step.finished_request_ids | step.preempted_request_ids
        selector.select_handoffs(step.handoffs, gone, require_tracked=eager, step=step)
        if not eager:
            if step.preempted_request_ids:  # its freed blocks may have held the cursor
                selector.lazy.cursor = None
            # Blocks allocated to running requests, as one batch (flattened in C).
            lazy = selector.lazy
            hits = None
            if lazy.held:  # rare: a failed forward's or a same-step victim's blocks
                hits = held_hits(selector.layout, lazy.held, selector.gpu_pool, step.scheduled)
            in_use = chain.from_iterable(ids for s in step.scheduled for ids in s.block_ids)
            lazy.note_blocks_in_use((list(in_use),))
            if lazy.record_loras:
                for scheduled in step.scheduled:
                    lazy.note_lora(scheduled.request, scheduled.block_ids)
            if hits:  # read, not written: still held
                lazy.hold_back(hits, hits.values())
            if selector.loaded.by_block:  # eager: `select_scheduled` notes them
                for scheduled in step.scheduled:
                    selector.loaded.note_in_use(scheduled.request.request_id, scheduled.block_ids)
            if walk:
                selector.select_lazy(self._lazy_target)
        jobs = []
        stores = selector.take_queued()
        if stores:
            gpu_ids = tuple(stores.gpu_block_ids)
            tier_ids = tuple(stores.tier_block_ids)
            records = self._store_records(stores, selector.gpu_pool)
            jobs.append(
                self._issue(Tier.GPU, self._tier, gpu_ids, tier_ids, records, stores=stores)
            )
        loads = self._loads.take_queued()
        for tier in self._index.tiers:
            parts = [item for item in loads if item.tier is tier]
            if parts:
                tier_ids = tuple(b for item in parts for b in item.tier_block_ids)
                gpu_ids = tuple(b for item in parts for b in item.gpu_block_ids)
                sizes = tuple(len(item.tier_block_ids) for item in parts)
                jobs.append(
                    self._issue(tier, Tier.GPU, tier_ids, gpu_ids, loads=parts, load_parts=sizes)
                )
        if self._cascade is not None:
            if walk:
                self._cascade.select_write_back()
                self._cascade.select_retries()
            moves = self._cascade.take_queued()
            if moves:
                cpu_ids = tuple(item.cpu_block_id for item in moves)
                disk_ids = tuple(item.disk_block_id for item in moves)
                records = self._cascade.records(moves) if self._persisting else ()
                jobs.append(
                    self._issue(Tier.CPU, Tier.DISK, cpu_ids, disk_ids, records, moves=moves)
                )
        self._next_step_id += 1
        return TransferPlan(
            step_id=self._next_step_id,
            jobs=tuple(jobs),
            load_request_ids=self._book.load_request_ids(),
            need_flush=bool(step.preempted_request_ids),
            end_persistence=self.persistence_ended,
            # Taken last: this step's completions and evictions are all noted by now.
            forget_slots=self._dropped.take() if self._dropped is not None else (),
        )

    def _loading(self, request_id: str) -> bool:
        """Return True while a load into the request's blocks awaits its report."""
        return any(request_id in ids for ids in self._book.load_request_ids().values())

    def forget(self, request_id: str) -> None:
        """Forget a finished request's last scheduled step."""
        if self._written is not None:
            self._written.pop(request_id, None)

    def _hold_back_unwritten(
        self, selector: StoreSelector, request: RequestView, written_tokens: int
    ) -> None:
        """Keep a preempted request's blocks that no forward wrote out of the tier.

        The engine may have scheduled the request again before preempting it in the same
        step (vLLM's priority policy: a running request short of blocks preempts the
        lowest-priority one, even one scheduled earlier in that `schedule()` call, and
        drops it from the step), hashing the blocks of that step's tokens as it
        allocated them; it frees them with their keys. Written are the tokens of its last
        scheduled step (from those confirmed then), less any draft tokens it rejected
        (`num_tokens - 1` bounds a decoding request's). Such blocks lose their keys in the
        engine's pool (`GpuPoolView.discard_keys_of`), so it serves none of them as a
        prefix hit, and are held back as a failed forward's are (lazy: the walk skips
        them; eager: no window position is recovered from one) until a request takes them
        again.
        """
        written_tokens = min(written_tokens, max(0, request.num_tokens - 1))
        gpu_pool = selector.gpu_pool
        block_ids = unwritten_blocks(
            selector.layout, request, written_tokens, self._config.max_batched_tokens, gpu_pool
        )
        if not block_ids:
            return
        if self._config.store_mode is StoreMode.LAZY:
            selector.lazy.hold_back(block_ids, gpu_pool.keys(block_ids))
        else:
            selector.unconfirmed.update(block_ids)
        gpu_pool.discard_keys_of(block_ids)  # the engine must not serve them either

    @property
    def _persisting(self) -> bool:
        """Return True while jobs into the disk tier carry records for its manifest."""
        return self._config.disk_persist and not self.persistence_ended

    def _issue(
        self,
        src: Tier,
        dst: Tier,
        src_ids: tuple[int, ...],
        dst_ids: tuple[int, ...],
        records: tuple[SlotRecord, ...] = (),
        *,
        loads: list[LoadItem] | None = None,
        stores: StoreBatch | None = None,
        moves: list[MoveItem] | None = None,
        load_parts: tuple[int, ...] = (),
    ) -> TransferJob:
        """Record one event copying `src_ids` to `dst_ids` in the book; return its job."""
        event_id = self._book.next_event_id()
        job = TransferJob(event_id, src, dst, src_ids, dst_ids, records, load_parts)
        self._book.issue(
            IssuedTransfer(job, loads=loads or [], stores=stores or StoreBatch(), moves=moves or [])
        )
        return job

    def _store_records(self, stores: StoreBatch, gpu_pool: GpuPoolView) -> tuple[SlotRecord, ...]:
        """Return the slot records of stores into a persistent disk tier, else ()."""
        if not self._persisting or self._tier is not Tier.DISK:
            return ()
        return self._registrar.records(stores, gpu_pool)
