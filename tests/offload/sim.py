"""Test doubles for driving the offload scheduler the way an engine does (SPEC §2).

- `SimRequest` and the content model (`sim_request`): a mutable request view whose block
  hashes grow with its tokens; a block's content is the key its KV encodes.
- `FakeWorker` (`sim_worker`): stands in for N offload workers. It records plans, holds
  every job until a test completes, fails or duplicates it, and models the bytes.
- `SimEngine`: a tiny engine around kvtier's `BlockPool` as the GPU pool. Its core
  (`sim_engine_core`) holds admission (local hit + tier lookup + allocate +
  on_allocated), the forward pass and reports; this module adds steps (schedule ->
  build_plan -> worker -> compute -> report), finish and preemption, and whole flows.
  It registers a GPU block's key once the block is full and computed; a loaded block
  gets its key when its load succeeds (as vLLM caches blocks of async-loaded requests),
  so nothing can hit bytes that have not arrived and a failed load leaves nothing
  cached. Before computing, it checks that every block the request reads holds the right
  content on every worker.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from sim_engine_core import Admission, Lookup, SimEngineCore
from sim_request import (
    BYTES_PER_BLOCK,
    SimRequest,
    block_content,
    block_key,
    config,
    content_index,
    full_layout,
    make_request,
    needed_positions,
)
from sim_worker import GARBAGE, Content, FakeWorker

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import Key
from kvtier.offload.plan import Tier, TransferJob, TransferPlan
from kvtier.offload.protocols import Handoff, ScheduledRequest, StepInput, TableUpdate

__all__ = [
    "BYTES_PER_BLOCK",
    "GARBAGE",
    "Admission",
    "Content",
    "FakeWorker",
    "Lookup",
    "SimEngine",
    "SimRequest",
    "block_content",
    "block_key",
    "config",
    "content_index",
    "full_layout",
    "keep_unwritten_keys",
    "make_request",
    "needed_positions",
]


# ---------------------------------------------------------------------------- engine


class SimEngine(SimEngineCore):
    """A minimal engine driving an `OffloadScheduler` and a `FakeWorker` (SPEC §2.2).

    `SimEngineCore` holds its state, admission, forward pass and reports.
    """

    # ------------------------------------------------------------ steps

    def is_runnable(self, request_id: str) -> bool:
        """Return True when the request holds blocks and waits for no load."""
        return request_id in self.requests and request_id not in self.loading

    def num_blocks_to_schedule(self, request_id: str, num_tokens: int) -> int:
        """Return how many new GPU blocks scheduling `num_tokens` more tokens needs."""
        request = self.requests[request_id]
        end = request.num_computed_tokens + self._scheduled.get(request_id, 0) + num_tokens
        table = self.tables[request_id]
        return sum(
            max(0, math.ceil(end / g.block_size) - len(table[i]))
            for i, g in enumerate(self.layout.groups)
        )

    def schedule(self, request_id: str, num_tokens: int | None = None) -> int:
        """Schedule tokens of a runnable request for the next step (default: all left)."""
        assert self.is_runnable(request_id), f"{request_id} is not runnable"
        request = self.requests[request_id]
        left = request.num_tokens - request.num_computed_tokens
        num_tokens = left if num_tokens is None else num_tokens
        assert 0 < num_tokens <= left, f"{request_id}: cannot schedule {num_tokens} of {left}"
        self._allocate_through(request_id, request.num_computed_tokens + num_tokens)
        self._scheduled[request_id] = num_tokens
        return num_tokens

    def schedule_drafts(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Schedule a decoding request's last token and `num_drafts` draft tokens
        (speculative decoding); its forward accepts the first `num_accepted` (its next
        outputs), as vLLM's rejection sampler: the step counts every draft, the request
        then holds the KV of its last token and the accepted drafts and samples one more
        token. The rejected drafts' positions keep what they held (wrong KV)."""
        request = self.requests[request_id]
        assert request.num_computed_tokens == request.num_tokens - 1, f"{request_id}: no decode"
        assert num_accepted <= num_drafts
        assert num_accepted < len(request.future_token_ids), "the bonus token is an output"
        self._allocate_through(request_id, request.num_tokens + num_drafts)
        self._scheduled[request_id] = 1 + num_drafts
        self._drafts[request_id] = num_accepted

    def _allocate_through(self, request_id: str, end: int) -> None:
        """Give the request the GPU blocks its tokens up to `end` need."""
        table = self.tables[request_id]
        appended = self._appended.setdefault(request_id, [[] for _ in self.layout.groups])
        for group_id, group in enumerate(self.layout.groups):
            new = self.gpu.allocate(
                max(0, math.ceil(end / group.block_size) - len(table[group_id]))
            )
            table[group_id].extend(new)
            appended[group_id].extend(new)

    def count_ahead(self, request_id: str) -> None:
        """Count the tokens scheduled for the next step as computed but unconfirmed
        (output placeholders), as async scheduling does, until the forward pass runs.

        The blocks they fill get their keys now, as vLLM hashes blocks as it schedules
        them: only the placeholders tell the scheduler their KV is not written yet.
        """
        request = self.requests[request_id]
        num_tokens = self._scheduled[request_id]
        start = request.num_computed_tokens
        request.num_computed_tokens += num_tokens
        request.num_output_placeholders += num_tokens
        self._ahead[request_id] = num_tokens
        self.learn_chain(request)
        table = self.tables[request_id]
        for group_id in self.layout.cacheable_group_ids:  # the blocks the forward writes
            group = self.layout.groups[group_id]
            first = start // group.block_size
            for pos in range(first, request.num_computed_tokens // group.block_size):
                block_id = table[group_id][pos]
                if block_id != NULL_BLOCK_ID and self.gpu.key(block_id) is None:
                    key = block_key(self.layout, request, group_id, pos)
                    self.gpu.insert_key(key, block_id, group.block_size)

    def store_of_finished(self, request: SimRequest) -> TransferJob:
        """Run `request` in one step, finish it and return the store job of its blocks.

        Turns `auto_complete` off first, so the store is left in flight.
        """
        self.auto_complete = False
        self.admit(request)
        self.schedule(request.request_id)
        self.step()
        self.finish(request.request_id)
        (store,) = self.step().jobs
        return store

    def handoff(self, request_id: str, group_id: int, gpu_block_id: int) -> None:
        """Offer a block of a group that is not positionally stable, with the next step."""
        self._handoffs.append(Handoff(request_id, group_id, gpu_block_id))

    def step_input(self) -> StepInput:
        """Return the next step's input and forget what was scheduled."""
        scheduled = []
        for request_id, num_tokens in self._scheduled.items():
            request = self.requests[request_id]
            if request_id in self._replace:
                block_ids = self.tables[request_id]
                update = TableUpdate.REPLACE
                self._replace.discard(request_id)
            else:
                block_ids = self._appended[request_id]
                update = TableUpdate.APPEND
            ids = tuple(tuple(group_ids) for group_ids in block_ids)
            scheduled.append(ScheduledRequest(request, ids, num_tokens, update))
        step = StepInput(
            tuple(scheduled),
            frozenset(self._finished),
            frozenset(self._preempted),
            tuple(self._handoffs),
        )
        self._appended.clear()
        self._finished.clear()
        self._preempted.clear()
        self._handoffs.clear()
        return step

    def step(self) -> TransferPlan:
        """Build the plan, hand it to the worker, run the forward pass and apply the report."""
        scheduled = dict(self._scheduled)
        self.last_forward.clear()
        step = self.step_input()
        self._scheduled.clear()
        plan = self.scheduler.build_plan(step)
        if plan.need_flush:  # the worker waits for what is in flight, then takes the plan
            self.worker.complete_all()
        self.worker.submit(plan)
        for request_id, num_tokens in scheduled.items():
            request = self.requests[request_id]
            accepted = self._drafts.pop(request_id, None)
            if accepted is not None:  # its accepted drafts are its next tokens
                for _ in range(accepted):
                    request.append_output()
                num_tokens = 1 + accepted
            self.compute(request, num_tokens)
        if self.auto_complete:
            self.worker.complete_all()
        self.poll()
        return plan

    # ------------------------------------------------------------ lifecycle

    def finish(
        self, request_id: str, request: SimRequest | None = None, *, computed: bool = True
    ) -> None:
        """Finish (or abort) a request: `on_finished`, then free its blocks tail-first
        (with their keys: `computed=False` is a failed forward's abort, as vLLM's)."""
        request = self.requests.pop(request_id, request)
        assert request is not None, f"unknown request {request_id}"
        table = self.tables.pop(request_id, [[] for _ in self.layout.groups])
        self.scheduler.on_finished(request, table, computed=computed)
        self._free_table(table)
        self.loading.pop(request_id, None)
        self._scheduled.pop(request_id, None)
        self._drafts.pop(request_id, None)
        self._appended.pop(request_id, None)
        self._replace.discard(request_id)
        self._finished.add(request_id)
        self._take_ahead(request)

    def preempt(self, request_id: str) -> SimRequest:
        """Preempt a running request: free its blocks; it must be admitted again."""
        assert self.is_runnable(request_id), f"{request_id} cannot be preempted"
        request = self.requests.pop(request_id)
        self._free_table(self.tables.pop(request_id))
        self._take_ahead(request)
        request.num_computed_tokens = 0
        self._scheduled.pop(request_id, None)
        self._drafts.pop(request_id, None)
        self._appended.pop(request_id, None)
        self._replace.discard(request_id)
        self._preempted.add(request_id)
        return request

    def scheduled_tokens(self) -> dict[str, int]:
        """Return the tokens scheduled for the next step, per request."""
        return dict(self._scheduled)

    def ran_since_admission(self, request_id: str) -> bool:
        """Return True when the request was scheduled in an earlier step since its
        admission (a running request, in vLLM's terms)."""
        return request_id in self.requests and request_id not in self._replace

    def preempt_scheduled(self, request_id: str) -> tuple[SimRequest, set[int]]:
        """Preempt a running request in the step that scheduled it, before any forward
        ran (vLLM's priority policy: `preempts_scheduled`), keying first the full blocks
        its scheduled tokens fill, as vLLM hashes blocks as it schedules them. Return the
        request and the blocks so keyed: never written."""
        assert self.ran_since_admission(request_id), f"{request_id} is not running"
        assert request_id not in self._ahead, "vLLM counts a step's tokens after scheduling"
        request = self.requests[request_id]
        start = request.num_computed_tokens
        end = start + self._scheduled[request_id]
        self.learn_chain(request)
        keyed = self.key_full_blocks(request_id, start, end)
        return self.preempt(request_id), keyed

    def key_full_blocks(self, request_id: str, start: int, end: int) -> set[int]:
        """Key the request's unkeyed GPU blocks that tokens [start, end) fill up, as
        vLLM's `allocate_slots` hashes them when it schedules them; return them."""
        request, table = self.requests[request_id], self.tables[request_id]
        keyed = set()
        for group_id in self.layout.cacheable_group_ids:
            size = self.layout.groups[group_id].block_size
            for pos in range(start // size, end // size):
                block_id = table[group_id][pos]
                if block_id != NULL_BLOCK_ID and self.gpu.key(block_id) is None:
                    key = block_key(self.layout, request, group_id, pos)
                    self.gpu.insert_key(key, block_id, size)
                    keyed.add(block_id)
        return keyed

    def drop_blocks(self, request_id: str, group_id: int, positions: Iterable[int]) -> None:
        """Null out blocks a sliding window no longer needs (they stay cached when hashed)."""
        table = self.tables[request_id][group_id]
        for pos in positions:
            self.gpu.free([table[pos]])
            table[pos] = NULL_BLOCK_ID

    def evict_gpu(self) -> None:
        """Evict every free cached GPU block (allocate them all, then free them)."""
        blocks = self.gpu.allocate(self.gpu.num_free())
        self.gpu.free(blocks)

    def engine_refs(self) -> Counter[int]:
        """Count the GPU references the engine itself holds (its requests' tables)."""
        refs: Counter[int] = Counter()
        for table in self.tables.values():
            refs.update(b for ids in table for b in ids if b != NULL_BLOCK_ID)
        return refs

    def _free_table(self, table: list[list[int]]) -> None:
        flat = [b for ids in table for b in ids]
        self.gpu.free(list(reversed(flat)))

    # ------------------------------------------------------------ whole flows

    def run(self, request: SimRequest, accept: int | None = None) -> Admission:
        """Admit a request, wait for its load, compute it to the end and finish it."""
        admission = self.admit(request, accept)
        assert admission is not None, f"{request.request_id}: no room on the GPU"
        while request.request_id in self.loading:
            self.step()
        while not request.is_done:
            self.schedule(request.request_id)
            self.step()
        self.finish(request.request_id)
        return admission

    def drain(self, max_steps: int = 20) -> None:
        """Step (completing every job) until no store is pending."""
        for _ in range(max_steps):
            if not self.scheduler.has_pending_stores() and not self.worker.in_flight:
                return
            self.step()
        raise AssertionError("stores did not drain")

    def check(self) -> None:
        """Check the scheduler's and the GPU pool's invariants."""
        self.scheduler.check_invariants()
        self.gpu.check_invariants()

    def tier_content(self, key: Key, tier: Tier | None = None) -> list[Content]:
        """Return what every worker holds in the slot of `key` (cached in `tier`).

        `tier` defaults to the tier GPU blocks are stored into.
        """
        tier = self.scheduler.tier if tier is None else tier
        slot = self.scheduler.index.pools[tier].cached_block(key)
        assert slot is not None, f"key not in the {tier.value} tier"
        return [space.get(slot) for space in self.worker.lower[tier.value]]


def keep_unwritten_keys(engine: SimEngine) -> None:
    """Make the engine's GPU pool ignore `discard_keys_of`: an engine that keeps serving
    blocks the offload scheduler knows were never written (vLLM 0.33 without the
    connector's call), for the guards behind that call."""
    engine.gpu.discard_keys_of = lambda block_ids: None  # type: ignore[method-assign]
