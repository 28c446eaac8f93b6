"""The core of `SimEngine` (`sim`): its state, admission, forward pass and reports.

- Admission: local hit + tier lookup + allocate + on_allocated (`Lookup`, `Admission`).
- Forward pass: writes each computed block's content on every worker and registers a GPU
  block's key once the block is full and computed; before computing, it checks that
  every block the request reads holds the right content on every worker.
- Reports: the worker's report goes to the scheduler; a loaded block gets its key when
  its load succeeds, and a failed load rewinds the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim_request import SimRequest, block_content, block_key, config, needed_positions
from sim_worker import Content, FakeWorker

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.core.longest_hit import find_longest_hit
from kvtier.offload.config import OffloadConfig
from kvtier.offload.protocols import Handoff
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from kvtier.offload.transfers import ReportOutcome

FAILED_FORWARD = "a failed forward's KV"  # what a failed forward pass leaves in a block


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


class SimEngineCore:
    """`SimEngine`'s state, admission, forward pass and reports (SPEC §2.2)."""

    def __init__(
        self,
        layout: KVLayout,
        offload_config: OffloadConfig | None = None,
        *,
        num_gpu_blocks: int = 16,
        num_tier_blocks: int = 8,
        num_workers: int = 1,
        num_disk_blocks: int = 0,
        preempts_scheduled: bool = False,
    ) -> None:
        """Build the engine; the tier has `num_tier_blocks` blocks, null block included.

        `num_disk_blocks` sizes the disk tier of a CPU+disk cascade config.
        `preempts_scheduled`: `SchedulerSetup`'s (a test preempts a request it scheduled).
        """
        self.layout = layout
        self.gpu = BlockPool(num_gpu_blocks)
        offload_config = config() if offload_config is None else offload_config
        setup = SchedulerSetup(
            layout,
            num_tier_blocks,
            num_workers,
            self.gpu,
            num_disk_blocks=num_disk_blocks,
            preempts_scheduled=preempts_scheduled,
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
        self._drafts: dict[str, int] = {}  # scheduled with drafts: how many it accepts
        self._finished: set[str] = set()
        self._preempted: set[str] = set()
        self._handoffs: list[Handoff] = []
        self._ahead: dict[str, int] = {}  # tokens counted computed before the forward
        # Per request of the last forward pass: the GPU blocks it wrote and what each
        # held before (`fail_forward`).
        self.last_forward: dict[str, list[tuple[int, Content]]] = {}

    # ------------------------------------------------------------ admission

    def local_hit(self, request: SimRequest) -> tuple[int, list[list[int]]]:
        """Return the GPU prefix hit in tokens and its block ids per group."""
        hit = find_longest_hit(
            self.layout, request.block_hashes, request.num_tokens - 1, self.cached_block
        )
        if request.skip_prefix_cache or hit.num_tokens == 0:
            return 0, [[] for _ in self.layout.groups]
        return hit.num_tokens, [list(ids) for ids in hit.block_ids]

    def cached_block(self, key: Key) -> int | None:
        """Return the GPU block cached under `key`, unless it holds other KV on a worker
        (a failed forward's, `fail_forward`: the engine frees it with its key, as vLLM
        does, but it is not this engine's cache that is under test)."""
        block_id = self.gpu.cached_block(key)
        if block_id is None:
            return None
        if all(key in self.covered.get(gpu.get(block_id), ()) for gpu in self.worker.gpu):
            return block_id
        return None

    def lookup(self, request: SimRequest, max_tokens: int | None = None) -> Lookup:
        """Find the request's local (GPU) hit, then ask the tier for more (pins the hit),
        at most `max_tokens` (None: no cap)."""
        self.learn_chain(request)
        num_local, local_ids = self.local_hit(request)
        offered = self.scheduler.lookup(request, num_local, max_tokens)
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
        for ids in found.local_ids:  # every hit first: allocating must not evict one
            self.gpu.touch(ids)
        tables = []
        for group_id, num_new in enumerate(new_per_group):
            tables.append(list(found.local_ids[group_id]) + self.gpu.allocate(num_new))
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

    # ------------------------------------------------------------ forward pass

    def compute(self, request: SimRequest, num_tokens: int) -> None:
        """Run the forward pass for `num_tokens` tokens: check reads, write, cache full blocks."""
        self._take_ahead(request)
        self.check_kv(request)
        start = request.num_computed_tokens
        end = start + num_tokens
        table = self.tables[request.request_id]
        written = self.last_forward.setdefault(request.request_id, [])
        for group_id, group in enumerate(self.layout.groups):
            if not group.is_cacheable:
                continue
            first = start // group.block_size
            for pos in range(first, math.ceil(end / group.block_size)):
                before = block_content(self.layout, request, group_id, pos, start)
                written.append((table[group_id][pos], before or FAILED_FORWARD))
                content = block_content(self.layout, request, group_id, pos, end)
                self.worker.write_gpu(table[group_id][pos], content)
        request.num_computed_tokens = end
        self.cache_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens and request.future_token_ids:
            request.append_output()

    def fail_forward(self, request_id: str) -> None:
        """Let the request's part of the last forward pass have failed: every block it
        wrote holds only what it held before, and `FAILED_FORWARD` past that (the whole
        block when it held no whole hash block before)."""
        for block_id, before in self.last_forward.get(request_id, ()):
            self.worker.write_gpu(block_id, before)

    def _take_ahead(self, request: SimRequest) -> None:
        """Uncount the tokens `count_ahead` counted: the forward pass computes them now."""
        num_tokens = self._ahead.pop(request.request_id, 0)
        request.num_computed_tokens -= num_tokens
        request.num_output_placeholders -= num_tokens

    def cache_full_blocks(self, request: SimRequest) -> None:
        """Register the key of every computed full block of the request (no-op if held).

        A block that does not hold its KV on every worker is skipped: a position a load
        left out (before a sliding window or a state) was never written.
        """
        self.learn_chain(request)
        table = self.tables[request.request_id]
        for group_id in self.layout.cacheable_group_ids:
            group = self.layout.groups[group_id]
            for pos in range(request.num_computed_tokens // group.block_size):
                block_id = table[group_id][pos]
                if block_id != NULL_BLOCK_ID and self.gpu.key(block_id) is None:
                    key = block_key(self.layout, request, group_id, pos)
                    if all(key in self.covered.get(g.get(block_id), ()) for g in self.worker.gpu):
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
