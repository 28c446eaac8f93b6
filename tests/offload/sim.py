"""Test doubles for driving the offload scheduler the way an engine does (SPEC §2).

- `SimRequest` and the content model (`sim_request`): a mutable request view whose block
  hashes grow with its tokens; a block's content is the key its KV encodes.
- `FakeWorker` (`sim_worker`): stands in for N offload workers. It records plans, holds
  every job until a test completes, fails or duplicates it, and models the bytes.
- `SimEngine`: a tiny engine around kvtier's `BlockPool` as the GPU pool: admission (local
  hit + tier lookup + allocate + on_allocated), steps (schedule -> build_plan -> worker ->
  compute -> report), finish and preemption. It registers a GPU block's key once the block
  is full and computed; a loaded block gets its key when its load succeeds (as vLLM caches
  blocks of async-loaded requests), so nothing can hit bytes that have not arrived and a
  failed load leaves nothing cached. Before computing, it checks that every block the
  request reads holds the right content on every worker.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

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

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import find_longest_hit
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier, TransferPlan
from kvtier.offload.protocols import Handoff, ScheduledRequest, StepInput, TableUpdate
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from kvtier.offload.transfers import ReportOutcome

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
    "make_request",
    "needed_positions",
]


# ---------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class Lookup:
    """A request's local hit (tokens, GPU block ids per group) and the tier's offer."""

    num_local_tokens: int
    local_ids: list[list[int]]
    num_offered_tokens: int


@dataclass(frozen=True)
class Admission:
    """What admitting a request found and accepted, in tokens."""

    num_local_tokens: int
    num_offered_tokens: int
    num_accepted_tokens: int


class SimEngine:
    """A minimal engine driving an `OffloadScheduler` and a `FakeWorker` (SPEC §2.2)."""

    def __init__(
        self,
        layout: KVLayout,
        offload_config: OffloadConfig | None = None,
        *,
        num_gpu_blocks: int = 16,
        num_tier_blocks: int = 8,
        num_workers: int = 1,
        num_disk_blocks: int = 0,
    ) -> None:
        """Build the engine; the tier has `num_tier_blocks` blocks, null block included.

        `num_disk_blocks` sizes the disk tier of a CPU+disk cascade config.
        """
        self.layout = layout
        self.gpu = BlockPool(num_gpu_blocks)
        offload_config = config() if offload_config is None else offload_config
        setup = SchedulerSetup(
            layout, num_tier_blocks, num_workers, self.gpu, num_disk_blocks=num_disk_blocks
        )
        self.scheduler = OffloadScheduler(offload_config, setup)
        self.worker = FakeWorker(num_workers, offload_config.tier.value)
        self.auto_complete = True  # step() completes every in-flight job before polling
        self.requests: dict[str, SimRequest] = {}  # admitted: they hold GPU blocks
        self.tables: dict[str, list[list[int]]] = {}
        self.loading: dict[str, Admission] = {}
        self.outcomes: list[ReportOutcome] = []
        self.covered: dict[Content, frozenset[Key]] = {}  # see learn_chain()
        self._replace: set[str] = set()
        self._appended: dict[str, list[list[int]]] = {}
        self._scheduled: dict[str, int] = {}
        self._finished: set[str] = set()
        self._preempted: set[str] = set()
        self._handoffs: list[Handoff] = []

    # ------------------------------------------------------------ admission

    def local_hit(self, request: SimRequest) -> tuple[int, list[list[int]]]:
        """Return the GPU prefix hit in tokens and its block ids per group."""
        hit = find_longest_hit(
            self.layout, request.block_hashes, request.num_tokens - 1, self.gpu.cached_block
        )
        if request.skip_prefix_cache or hit.num_tokens == 0:
            return 0, [[] for _ in self.layout.groups]
        return hit.num_tokens, [list(ids) for ids in hit.block_ids]

    def lookup(self, request: SimRequest) -> Lookup:
        """Find the request's local (GPU) hit, then ask the tier for more (pins the hit)."""
        self.learn_chain(request)
        num_local, local_ids = self.local_hit(request)
        offered = self.scheduler.lookup(request, num_local)
        return Lookup(num_local, local_ids, offered)

    def allocate(
        self, request: SimRequest, found: Lookup, accept: int | None = None
    ) -> Admission | None:
        """Allocate GPU blocks for the local + accepted tokens, then call `on_allocated`.

        `accept` is the number of external tokens taken (default: all offered). Returns
        None, changing nothing, when the GPU pool cannot hold the blocks.
        """
        accepted = found.num_offered_tokens if accept is None else accept
        end = found.num_local_tokens + accepted
        new_per_group = []
        for group_id, group in enumerate(self.layout.groups):
            num_blocks = math.ceil(end / group.block_size)
            new_per_group.append(max(0, num_blocks - len(found.local_ids[group_id])))
        hit_blocks = {b for ids in found.local_ids for b in ids if b != NULL_BLOCK_ID}
        num_free_hits = sum(1 for b in hit_blocks if self.gpu.ref_count(b) == 0)
        if not self.gpu.can_allocate(sum(new_per_group) + num_free_hits):
            return None
        tables = []
        for group_id, num_new in enumerate(new_per_group):
            ids = list(found.local_ids[group_id])
            self.gpu.touch(ids)
            tables.append(ids + self.gpu.allocate(num_new))
        self.scheduler.on_allocated(request, tables, accepted)
        request.num_computed_tokens = end
        admission = Admission(found.num_local_tokens, found.num_offered_tokens, accepted)
        self.requests[request.request_id] = request
        self.tables[request.request_id] = tables
        self._replace.add(request.request_id)
        if accepted:
            self.loading[request.request_id] = admission
        return admission

    def admit(self, request: SimRequest, accept: int | None = None) -> Admission | None:
        """Admit a waiting request: `lookup`, then `allocate` (None: no room, pin kept)."""
        return self.allocate(request, self.lookup(request), accept)

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
        end = request.num_computed_tokens + num_tokens
        table = self.tables[request_id]
        appended = self._appended.setdefault(request_id, [[] for _ in self.layout.groups])
        for group_id, group in enumerate(self.layout.groups):
            new = self.gpu.allocate(
                max(0, math.ceil(end / group.block_size) - len(table[group_id]))
            )
            table[group_id].extend(new)
            appended[group_id].extend(new)
        self._scheduled[request_id] = num_tokens
        return num_tokens

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
        step = self.step_input()
        self._scheduled.clear()
        plan = self.scheduler.build_plan(step)
        self.worker.submit(plan)
        if plan.need_flush:
            self.worker.complete_all()
        for request_id, num_tokens in scheduled.items():
            self.compute(self.requests[request_id], num_tokens)
        if self.auto_complete:
            self.worker.complete_all()
        self.poll()
        return plan

    def compute(self, request: SimRequest, num_tokens: int) -> None:
        """Run the forward pass for `num_tokens` tokens: check reads, write, cache full blocks."""
        self.check_kv(request)
        start = request.num_computed_tokens
        end = start + num_tokens
        table = self.tables[request.request_id]
        for group_id, group in enumerate(self.layout.groups):
            if not group.is_cacheable:
                continue
            first = start // group.block_size
            for pos in range(first, math.ceil(end / group.block_size)):
                content = block_content(self.layout, request, group_id, pos, end)
                self.worker.write_gpu(table[group_id][pos], content)
        request.num_computed_tokens = end
        self.cache_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens and request.future_token_ids:
            request.append_output()

    def cache_full_blocks(self, request: SimRequest) -> None:
        """Register the key of every computed full block of the request (no-op if held)."""
        table = self.tables[request.request_id]
        for group_id in self.layout.cacheable_group_ids:
            group = self.layout.groups[group_id]
            for pos in range(request.num_computed_tokens // group.block_size):
                block_id = table[group_id][pos]
                if block_id != NULL_BLOCK_ID and self.gpu.key(block_id) is None:
                    key = block_key(self.layout, request, group_id, pos)
                    self.gpu.insert_key(key, block_id, group.block_size)

    def learn_chain(self, request: SimRequest) -> None:
        """Record, for each key of the request, every key whose KV a block holding it holds.

        A block's content is the key of its last whole hash block; it also holds the KV
        of the partial tails before that one in the same block.
        """
        for group_id in self.layout.cacheable_group_ids:
            ratio = self.layout.blocks_per_hash(group_id)
            keys = [make_key(h, group_id) for h in request.block_hashes]
            for i, key in enumerate(keys):
                if key not in self.covered:
                    self.covered[key] = frozenset(keys[i - i % ratio : i + 1])

    def check_kv(self, request: SimRequest) -> None:
        """Assert every block the request reads holds its KV on every worker.

        A block may hold more than the request needs from it (a whole block loaded for a
        hit that ends inside it): its content only has to cover what is needed.
        """
        self.learn_chain(request)
        table = self.tables[request.request_id]
        num_tokens = request.num_computed_tokens
        for group_id in self.layout.cacheable_group_ids:
            group = self.layout.groups[group_id]
            for pos in needed_positions(group, num_tokens):
                want = block_content(self.layout, request, group_id, pos, num_tokens)
                if want is None:
                    continue
                block_id = table[group_id][pos]
                for worker, gpu in enumerate(self.worker.gpu):
                    assert want in self.covered.get(gpu.get(block_id), ()), (
                        f"{request.request_id}: group {group_id} block {pos} (GPU {block_id}) "
                        f"holds wrong KV on worker {worker}"
                    )

    # ------------------------------------------------------------ reports

    def poll(self) -> ReportOutcome:
        """Hand the worker's report to the scheduler and act on finished and failed loads."""
        outcome = self.scheduler.apply_report(self.worker.take_report())
        self.outcomes.append(outcome)
        for request_id in outcome.finished_loads:
            if self.loading.pop(request_id, None) is not None:
                request = self.requests[request_id]
                self.check_kv(request)
                self.cache_full_blocks(request)
        for failure in outcome.failed_loads:
            admission = self.loading.pop(failure.request_id, None)
            if admission is not None:
                assert failure.start_token == admission.num_local_tokens
                assert failure.end_token - failure.start_token == admission.num_accepted_tokens
                self.requests[failure.request_id].num_computed_tokens = failure.start_token
        return outcome

    # ------------------------------------------------------------ lifecycle

    def finish(self, request_id: str, request: SimRequest | None = None) -> None:
        """Finish (or abort) a request: `on_finished`, then free its blocks tail-first."""
        request = self.requests.pop(request_id, request)
        assert request is not None, f"unknown request {request_id}"
        table = self.tables.pop(request_id, [[] for _ in self.layout.groups])
        self.scheduler.on_finished(request, table)
        self._free_table(table)
        self.loading.pop(request_id, None)
        self._scheduled.pop(request_id, None)
        self._appended.pop(request_id, None)
        self._replace.discard(request_id)
        self._finished.add(request_id)

    def preempt(self, request_id: str) -> SimRequest:
        """Preempt a running request: free its blocks; it must be admitted again."""
        assert self.is_runnable(request_id), f"{request_id} cannot be preempted"
        request = self.requests.pop(request_id)
        self._free_table(self.tables.pop(request_id))
        request.num_computed_tokens = 0
        self._scheduled.pop(request_id, None)
        self._appended.pop(request_id, None)
        self._replace.discard(request_id)
        self._preempted.add(request_id)
        return request

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
