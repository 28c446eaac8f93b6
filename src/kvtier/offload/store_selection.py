"""Choosing GPU blocks to copy down to the tier (SPEC §6.5 eager, §6.6 lazy, §6.7 finish).

`StoreSelector` decides; every accepted candidate is pinned on the GPU, given a freshly
allocated tier slot and queued in a `StoreBatch` until `build_plan` issues it. Keys whose
store is queued or in flight are tracked so no block is stored twice.

A disk-only tier's failed stores hold their slots as suspects (`disk_slots`): freed, they
were reused first, and one bad slot failed every later store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.core.policies import AdmissionPolicy, AdmitAll
from kvtier.offload.block_payload import (
    block_payload,
    describe_handoff,
    request_key,
    secondary_payloads,
    tail_payload,
)
from kvtier.offload.disk_slots import SetAsideSlots
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.lazy_walk import LazyWalk
from kvtier.offload.loaded_blocks import LoadedBlocks
from kvtier.offload.partial_states import is_partial_state, without_partial_states
from kvtier.offload.protocols import (
    GpuPoolView,
    Handoff,
    RequestView,
    ScheduledRequest,
    StepInput,
    TableUpdate,
)
from kvtier.offload.request_tags import RequestTags, TagOf
from kvtier.offload.stats import StepCounters, StoreOutcome
from kvtier.offload.store_batch import StoreBatch
from kvtier.offload.store_queueing import StoreQueueing
from kvtier.offload.store_runs import count_unselected, select_run
from kvtier.offload.unconfirmed_hits import skip_hit, take_unconfirmed

_NEVER = 2**63  # `_Tracked.next_ready` of a request with no positional group


@dataclass(slots=True)
class _Tracked:
    """Store tracking of one request (eager mode): its block table and a cursor per group.

    `deferred` is, per group, the position last counted as deferred by a full tier (-1:
    none), so a block that waits for a slot over many steps counts once. `next_ready`:
    the fewest confirmed tokens that complete the block at some positional group's cursor
    (`_NEVER` without such a group), kept with the cursors: one comparison per step
    tells whether the request has anything to select. `view` and `written_end`: the
    request as last scheduled and where that step ends, counted from its confirmed
    tokens (an engine may count a step's own tokens computed ahead of its forward, as
    placeholders; `preempted_stores`).
    """

    block_ids: list[list[int]]
    cursors: list[int]
    deferred: list[int]
    next_ready: int
    view: RequestView | None = None
    written_end: int = 0


@dataclass(slots=True)
class StoreSelector(StoreQueueing):
    """Select store candidates; owns the request tables, cursors and in-flight keys.

    Pinning, slotting and queueing an accepted block: `StoreQueueing`, a mixin.
    """

    layout: KVLayout
    gpu_pool: GpuPoolView
    tier_pool: BlockPool
    counters: StepCounters
    record_payload: bool
    fine_grained: bool
    queued: StoreBatch = field(default_factory=StoreBatch)
    in_flight_keys: set[Key] = field(default_factory=set)
    tracked: dict[str, _Tracked] = field(default_factory=dict)
    lazy: LazyWalk = field(default_factory=LazyWalk)
    # With a cascade: the GPU blocks landed loads filled, until their first store.
    loaded: LoadedBlocks = field(default_factory=LoadedBlocks)
    admission: AdmissionPolicy = field(default_factory=AdmitAll)
    # The token check on: the requests' tags, recorded with what their blocks' stores copy.
    tags: RequestTags | None = None
    # Requests known at a reset and not looked up since: never tracked again (their KV
    # predates the reset; an async load's second `on_allocated` must not track them).
    across_reset: set[str] = field(default_factory=set)
    # A disk tier's slots of failed stores, held (None for a CPU tier: see `disk_slots`).
    set_aside: SetAsideSlots | None = None
    # The token check on a disk-only tier: where the slots of the untagged copies a
    # tagged store replaces go (their manifest records are dropped); None: no replacing.
    replaced: DroppedSlots | None = None
    # Eager mode: GPU blocks of unconfirmed compute (a failed forward's, a priority
    # victim's dropped step), which vLLM keeps cached under their keys; a window's null
    # position is never recovered from one. A block leaves once a scheduled request
    # writes it again, not when it reads it as a hit (`unconfirmed_hits`).
    unconfirmed: set[int] = field(default_factory=set)
    # `_next_ready` of all-zero cursors (every fresh table's), computed once.
    _first_ready: int = field(init=False, default=-1)

    # ------------------------------------------------------------ request tracking

    def track(self, request_id: str) -> None:
        """Start tracking `request_id` (once) with an empty table, unless it ran across a
        reset and was not looked up since."""
        if request_id not in self.tracked and request_id not in self.across_reset:
            self.tracked[request_id] = self._empty()

    def untrack(self, request_id: str) -> None:
        """Forget a request's table and cursors."""
        self.tracked.pop(request_id, None)

    def reset_request(self, request_id: str) -> None:
        """Reset a preempted request's table and cursors."""
        if request_id in self.tracked:
            self.tracked[request_id] = self._empty()

    def _empty(self) -> _Tracked:
        num_groups = len(self.layout.groups)
        cursors = [0] * num_groups
        if self._first_ready < 0:
            self._first_ready = self._next_ready(cursors)
        return _Tracked(
            [[] for _ in range(num_groups)], cursors, [-1] * num_groups, self._first_ready
        )

    def _next_ready(self, cursors: list[int]) -> int:
        """Return `_Tracked.next_ready` of `cursors`."""
        return min(
            ((cursors[group_id] + 1) * size for group_id, size in self.layout.positional_groups),
            default=_NEVER,
        )

    # ------------------------------------------------------------ selection

    def confirmed_tokens(self, request: RequestView) -> int:
        """Return the tokens whose KV is confirmed computed, rounded down to the unit."""
        unit = self.confirm_unit()
        confirmed = request.num_computed_tokens - request.num_output_placeholders
        return max(0, confirmed) // unit * unit

    def confirm_unit(self) -> int:
        return (
            self.layout.hash_block_size if self.fine_grained else self.layout.scheduler_block_size
        )

    def select_scheduled(self, scheduled: Iterable[ScheduledRequest]) -> None:
        """Apply each scheduled request's new block ids, then select as `select_request` does.

        The eager hot path of a step, in one loop: a request not tracked is skipped; one
        with no newly confirmed block (most decode steps) costs a table update and one
        comparison. A request preempted this step is scheduled only resumed, its table
        replaced (`StepInput`).
        """
        tracked = self.tracked
        unit = self.confirm_unit()
        replace_table = TableUpdate.REPLACE
        if self.tags is not None:  # every new block's old note goes before anyone reads it
            scheduled = tuple(scheduled)
            for item in scheduled:  # where each request's new blocks start, per group
                found = self.tracked.get(item.request.request_id)
                replace = item.table_update is TableUpdate.REPLACE or found is None
                firsts = [0 if replace else len(t) for t in found.block_ids] if found else None
                self.tags.forget_fills(item.request.request_id, item.block_ids, firsts)
        loaded = self.loaded
        for request, block_ids, num_scheduled, table_update in scheduled:
            request_id = request.request_id
            held_hit = 0  # a block taken again is written, unless read as a hit
            if self.unconfirmed:
                held_hit = take_unconfirmed(
                    self.unconfirmed, self.layout, request, block_ids, table_update
                )
            if loaded.by_block:  # another request's use of a loaded block is its own
                loaded.note_in_use(request_id, block_ids)
            if table_update is replace_table:
                if request_id in self.across_reset:
                    continue
                state = tracked[request_id] = self._empty()
            else:
                found = tracked.get(request_id)
                if found is None:
                    continue
                state = found
            if len(block_ids) != len(state.block_ids):  # before any table changes
                raise ValueError(
                    f"request {request_id!r}: block ids for {len(block_ids)} KV groups, "
                    f"the layout has {len(state.block_ids)}"
                )
            # Most decode steps bring no new block: the zip then changes nothing, and
            # skipping it saves 0.3 µs a request.
            if any(block_ids):
                for table, new_ids in zip(state.block_ids, block_ids, strict=True):
                    if new_ids:
                        table.extend(new_ids)
            if held_hit:  # a hit on unwritten KV: none of the hit's blocks is stored
                skip_hit(self.layout, state.cursors, held_hit)
                state.next_ready = self._next_ready(state.cursors)
            confirmed = request.num_computed_tokens - request.num_output_placeholders
            state.view, state.written_end = request, confirmed + num_scheduled
            ready_tokens = confirmed // unit * unit
            if ready_tokens >= state.next_ready:
                self._select_ready(request, state, ready_tokens)

    def select_request(self, request: RequestView, state: _Tracked, final: bool = False) -> None:
        """Select a request's confirmed, positionally stable blocks from its cursors on.

        `final` (the request finished): nothing is retried, so the blocks a full tier
        stops at are counted as dropped (`count_unselected`).
        """
        ready_tokens = self.confirmed_tokens(request)
        if ready_tokens >= state.next_ready:  # else no group has a block to select
            self._select_ready(request, state, ready_tokens, final)

    def select_over(self, request: RequestView, tables: list[list[int]], ready_tokens: int) -> None:
        """Select a tracked request's blocks from its cursors up to `ready_tokens` over
        `tables` (its own, cut short: `preempted_stores`), retrying nothing."""
        state = self.tracked[request.request_id]
        found = _Tracked(tables, list(state.cursors), list(state.deferred), state.next_ready)
        self._select_ready(request, found, ready_tokens, final=True)

    def _select_ready(
        self, request: RequestView, state: _Tracked, ready_tokens: int, final: bool = False
    ) -> None:
        """Select from the cursors up to `ready_tokens`; a full tier stops a group's walk
        (the block is retried next step and counted once as deferred) unless `final`."""
        cursors = state.cursors
        for group_id, block_size in self.layout.positional_groups:
            pos = cursors[group_id]
            if (pos + 1) * block_size > ready_tokens:
                continue  # nothing new is confirmed (most decode steps)
            table = state.block_ids[group_id]
            num_ready = min(ready_tokens // block_size, len(table))
            tag_of = None if self.tags is None else self.tags.by_position(request, group_id)
            while pos < num_ready:
                if not self.record_payload and table[pos] != NULL_BLOCK_ID:
                    pos = select_run(self, table, pos, num_ready, tag_of)
                    if pos < num_ready and table[pos] != NULL_BLOCK_ID:
                        break  # the tier is full: retry later, the cursor does not advance
                    continue
                outcome = self._select_position(request, group_id, table, pos, tag_of)
                if outcome is StoreOutcome.TIER_FULL:
                    break  # retry later: the cursor does not advance
                pos += 1
            if pos < num_ready:  # stopped at a full tier
                if final:
                    count_unselected(self, request, group_id, table, pos, num_ready)
                    pos = num_ready
                elif state.deferred[group_id] != pos:
                    self.counters.count_store(StoreOutcome.DEFERRED)
                    state.deferred[group_id] = pos
            state.cursors[group_id] = pos
        state.next_ready = self._next_ready(state.cursors)

    def _select_position(
        self,
        request: RequestView,
        group_id: int,
        table: Sequence[int],
        pos: int,
        tag_of: TagOf | None = None,
    ) -> StoreOutcome:
        gpu_block_id = table[pos]
        recovered = False
        if gpu_block_id == NULL_BLOCK_ID:
            # A sliding window dropped this block; it may still be cached on the GPU.
            key = request_key(self.layout, request, group_id, pos)
            cached = None if key is None else self.gpu_pool.cached_block(key)
            if cached in self.unconfirmed:  # another copy of the key, or none
                assert key is not None
                copies = self.gpu_pool.cached_blocks(key)
                cached = next((b for b in copies if b not in self.unconfirmed), None)
            if cached is None:
                self.counters.count_store(StoreOutcome.NULL)
                return StoreOutcome.NULL
            gpu_block_id, recovered = cached, True
        payload = (
            block_payload(self.layout, request, group_id, pos) if self.record_payload else None
        )
        outcome = self.try_select(
            gpu_block_id,
            stored=payload,
            tag=None
            if self.tags is None or tag_of is None
            else self.tags.position_tag(self.gpu_pool, gpu_block_id, pos, recovered, tag_of),
        )
        if outcome is not StoreOutcome.TIER_FULL:  # the caller counts it: dropped or deferred
            self.counters.count_store(outcome)
        if payload is not None and outcome is StoreOutcome.STORED:
            secondary = self.gpu_pool.secondary_keys(gpu_block_id)  # fine-grained entries
            if secondary:
                found = secondary_payloads(self.layout, request, group_id, pos, secondary)
                if found:
                    self.queued.secondary_payloads[len(self.queued) - 1] = found
        return outcome

    def select_lazy(self, target: int) -> None:
        """Walk the GPU free queue from the cursor and select up to `target` visited blocks."""
        lazy = self.lazy
        visited, keys = self.gpu_pool.free_after(lazy.cursor, target)
        if not visited:
            return  # nothing new since the cursor: stay where we are
        run, run_keys = visited, keys
        if self.layout.coarse_state_groups:
            run, run_keys = without_partial_states(self.layout, self.gpu_pool, visited, keys)
            self.counters.count_many(StoreOutcome.PARTIAL_STATE, len(visited) - len(run))
        num_queued = len(self.queued)
        end = select_run(self, run, 0, len(run), known_keys=run_keys)
        stop = len(visited)
        if end < len(run):  # stopped: tier full
            stop = end if run is visited else visited.index(run[end])
            if run[end] not in lazy.deferred:
                self.counters.count_store(StoreOutcome.DEFERRED)
                lazy.deferred.add(run[end])
        selected = set(self.queued.gpu_block_ids[num_queued:])
        if selected and (lazy.loras or lazy.extra_keys):  # for their events
            lazy.describe(self.queued, num_queued)
        lazy.deferred.difference_update(selected)
        lazy.copying |= selected
        # Resume after the last visited block still in the free queue (not pinned now).
        lazy.cursor = next((b for b in reversed(visited[:stop]) if b not in selected), lazy.cursor)

    def select_handoffs(
        self,
        handoffs: Iterable[Handoff],
        gone: frozenset[str],
        require_tracked: bool,
        step: StepInput | None = None,
    ) -> None:
        """Select hand-offs, dropping those of finished, preempted or unknown requests.

        A store's event names its request's adapter: the request as tracked, or as the
        `step` schedules it, or the lazy walk's note of the block.
        """
        for handoff in handoffs:
            known = handoff.request_id in self.tracked or not require_tracked
            if not known or handoff.request_id in gone:
                outcome = StoreOutcome.REQUEST_GONE
            elif not self.layout.groups[handoff.group_id].is_cacheable:
                outcome = StoreOutcome.NULL
            elif self.layout.coarse_state_groups and is_partial_state(
                self.layout, self.gpu_pool, handoff.gpu_block_id
            ):
                outcome = StoreOutcome.PARTIAL_STATE
            else:
                self.loaded.note_in_use(handoff.request_id, ((handoff.gpu_block_id,),))
                tag = None
                if self.tags is not None:
                    tag = self.tags.of_block(
                        handoff.request_id, self.gpu_pool, handoff.gpu_block_id
                    )
                outcome = self.try_select(handoff.gpu_block_id, tag=tag)
                if outcome is StoreOutcome.STORED:
                    state = self.tracked.get(handoff.request_id)
                    view = None if state is None else state.view
                    lazy = self.lazy  # events on: its extra keys too (`record_loras`)
                    args = (self.layout, self.gpu_pool) if lazy.record_loras else None
                    describe_handoff(self.queued, handoff, view, step, lazy.loras, args)
            self.counters.count_handoff(outcome)

    def select_partial_tail(self, request: RequestView, state: _Tracked) -> None:
        """Select the full-attention partial tail of a finished request (fine-grained)."""
        confirmed = self.confirmed_tokens(request)
        hbs = self.layout.hash_block_size
        for group_id in self.layout.cacheable_group_ids:
            group = self.layout.groups[group_id]
            if group.kind is not GroupKind.FULL_ATTENTION or group.block_size == hbs:
                continue
            pos, rest = divmod(confirmed, group.block_size)
            table = state.block_ids[group_id]
            if rest == 0 or pos >= len(table):
                continue
            last_hash = confirmed // hbs - 1
            key = make_key(request.block_hashes[last_hash], group_id)
            tag = None
            if self.tags is not None and pos >= self.tags.floor(request.request_id, group_id):
                tag = (key, self.tags.of(request)[last_hash])
            stored = None
            if self.record_payload:
                stored = tail_payload(self.layout, request, group_id, confirmed)
            outcome = self.try_select(
                table[pos], tail_key=key, tail_num_tokens=rest, stored=stored, tag=tag
            )
            self.counters.count_store(outcome)

    def take_queued(self) -> StoreBatch:
        """Return and forget the stores selected since the last call."""
        queued, self.queued = self.queued, StoreBatch()
        return queued
