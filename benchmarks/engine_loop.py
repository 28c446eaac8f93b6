"""An engine-like scheduling loop that drives kvtier's offload scheduler (for benchmarks).

Two separable parts:

- `Workload` / `WorkloadConfig` (`engine_workload`): a seeded request stream (prompts of
  about 2 k tokens, half of them starting with one of several shared system prefixes of
  Zipf popularity, 32-256 output tokens). Request `i` depends only on the seed and `i`,
  so every mode (offload off, eager, lazy) and any other engine driven by the same
  stream (e.g. vLLM's Scheduler) sees the same requests. Prompt block hashes are
  computed here, outside any timed region: an engine hashes a prompt when the request
  arrives (vLLM: in `Request.__init__`), not in its scheduler step.
- `EngineLoop`: what an engine's scheduler does every step, modelled on vLLM v1's
  `Scheduler.schedule()` + `update_from_output()`: running requests first (token budget,
  chunked prefill, slot allocation, preemption of the newest request when the pool is
  full), then FCFS admission (local prefix lookup, tier lookup, allocation), the
  scheduler output, "compute" (advance counters, register the keys of newly full blocks in
  the GPU pool), sampling (hashing each newly full output block), finishes. The GPU pool
  is kvtier's `BlockPool`; the closed loop keeps `max_num_seqs + waiting_depth` requests
  in the system. Its data (`Request`, `EngineConfig`, `LoopTimes`, `LoopCounters`) is in
  `engine_loop_types`; this module re-exports them and the workload.

Timing (`clock`, ns; `time.perf_counter_ns` by default): every kvtier call, and building
its `StepInput` (an adapter's job), is charged to `kvtier`; the fake worker to `worker`;
request arrival to `frontend`; everything else the step does to `engine`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from time import perf_counter_ns

from engine_loop_types import (
    GROUP_ID,
    KV_CALLS,
    EngineConfig,
    LoopCounters,
    LoopTimes,
    Request,
)
from engine_workload import RequestSpec, Workload, WorkloadConfig
from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import make_key
from kvtier.offload.plan import TransferPlan, WorkerReport
from kvtier.offload.protocols import ScheduledRequest, StepInput, TableUpdate
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.offload.stats import OffloadStats

__all__ = [
    "GROUP_ID",
    "KV_CALLS",
    "EngineConfig",
    "EngineLoop",
    "FakeWorker",
    "LoopCounters",
    "LoopTimes",
    "Request",
    "RequestSpec",
    "Workload",
    "WorkloadConfig",
]

# ----------------------------------------------------------------------------- worker


class FakeWorker:
    """Complete every transfer job one step after it was submitted."""

    def __init__(self) -> None:
        self._submitted: list[int] = []
        self._in_flight: list[int] = []

    def submit(self, plan: TransferPlan) -> None:
        self._submitted.extend(job.event_id for job in plan.jobs)

    def poll(self) -> WorkerReport:
        done, self._in_flight, self._submitted = self._in_flight, self._submitted, []
        return WorkerReport(done=dict.fromkeys(done, 1))


# ----------------------------------------------------------------------------- loop


class EngineLoop:
    """Drive one engine-like scheduling loop; `sched` None means offload off."""

    def __init__(
        self,
        config: EngineConfig,
        workload: Workload,
        sched: OffloadScheduler | None,
        gpu: BlockPool,
        clock: Callable[[], int] = perf_counter_ns,
    ) -> None:
        self.config = config
        self.clock = clock  # ns; perf_counter_ns (wall) or thread_time_ns (CPU time)
        self.workload = workload
        self.sched = sched
        self.gpu = gpu
        self.hasher = workload.hasher
        self.worker = FakeWorker()
        self.times = LoopTimes()
        self.counters = LoopCounters()
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.loading: dict[str, Request] = {}
        self._next_index = 0
        self._finished_ids: list[str] = []  # since the last plan
        self.last_output: dict[str, int] = {}

    # ------------------------------------------------------------------ step

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self.step()

    def reset_times(self) -> None:
        self.times = LoopTimes()

    def step(self) -> None:
        now = self.clock
        t_start = now()
        kv = self.times.kvtier_ns
        kv_before = sum(kv.values())
        worker_before = self.times.worker_ns
        frontend_before = self.times.frontend_ns
        self._arrive()
        scheduled, preempted = self._schedule()
        # The scheduler output the model runner gets (vLLM: SchedulerOutput).
        self.last_output = {req.request_id: n for req, _, n, _ in scheduled}
        sched = self.sched
        if sched is not None:
            t0 = now()
            step_input = StepInput(
                scheduled=tuple(
                    ScheduledRequest(
                        req,
                        (tuple(req.blocks) if is_new else tuple(new_blocks),),
                        n,
                        TableUpdate.REPLACE if is_new else TableUpdate.APPEND,
                    )
                    for req, new_blocks, n, is_new in scheduled
                ),
                finished_request_ids=frozenset(self._finished_ids),
                preempted_request_ids=frozenset(r.request_id for r in preempted),
            )
            t05 = now()
            plan = sched.build_plan(step_input)
            t1 = now()
            kv["step_input"] += t05 - t0
            kv["build_plan"] += t1 - t05
            self.worker.submit(plan)
            self.times.worker_ns += now() - t1
        self._finished_ids = []
        finished = self._compute(scheduled)
        if finished:
            self._finish(finished)
        if sched is not None:
            t0 = now()
            report = self.worker.poll()
            t1 = now()
            outcome = sched.apply_report(report)
            t2 = now()
            stats = sched.take_stats()
            t3 = now()
            self.times.worker_ns += t1 - t0
            kv["apply_report"] += t2 - t1
            kv["take_stats"] += t3 - t2
            for request_id in outcome.finished_loads:
                self._load_done(self.loading.pop(request_id))
            assert not outcome.failed_loads
            self._count(stats)
        total = now() - t_start
        times = self.times
        times.num_steps += 1
        times.engine_ns += (
            total
            - (sum(kv.values()) - kv_before)
            - (times.worker_ns - worker_before)
            - (times.frontend_ns - frontend_before)
        )

    # ------------------------------------------------------------------ phases

    def _arrive(self) -> None:
        """Closed loop: keep max_num_seqs + waiting_depth requests in the system."""
        now = self.clock
        t0 = now()
        target = self.config.max_num_seqs + self.config.waiting_depth
        while len(self.running) + len(self.waiting) + len(self.loading) < target:
            self.waiting.append(Request(self.workload.spec(self._next_index)))
            self._next_index += 1
        self.times.frontend_ns += now() - t0

    def _schedule(self) -> tuple[list[tuple[Request, list[int], int, bool]], list[Request]]:
        """Running requests first, then FCFS admission; return (scheduled, preempted)."""
        gpu = self.gpu
        bs = self.config.block_size
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, list[int], int, bool]] = []
        preempted: list[Request] = []
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                n = budget
                self.counters.num_chunked_prefills += 1
            need = -(-(req.num_computed_tokens + n) // bs) - len(req.blocks)
            new_blocks: list[int] = []
            if need > 0:
                while not gpu.can_allocate(need):
                    victim = running.pop()  # the newest request is preempted first
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
                if preempted and preempted[-1] is req:
                    break
                new_blocks = gpu.allocate(need)
                req.blocks.extend(new_blocks)
            scheduled.append((req, new_blocks, n, False))
            budget -= n
            i += 1
        if not preempted:
            self._admit(scheduled, budget)
        return scheduled, preempted

    def _admit(self, scheduled: list[tuple[Request, list[int], int, bool]], budget: int) -> None:
        now = self.clock
        gpu = self.gpu
        sched = self.sched
        bs = self.config.block_size
        kv = self.times.kvtier_ns
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = waiting[0]
            if req.num_computed_tokens > 0:  # its load finished: blocks already allocated
                n = req.num_tokens - req.num_computed_tokens
                if n > budget:
                    n = budget
                    self.counters.num_chunked_prefills += 1
                need = -(-(req.num_computed_tokens + n) // bs) - len(req.blocks)
                if need > 0:
                    if not gpu.can_allocate(need):
                        break
                    req.blocks.extend(gpu.allocate(need))
                waiting.popleft()
                self.running.append(req)
                scheduled.append((req, req.blocks, n, True))
                budget -= n
                continue
            max_hit_blocks = (req.num_tokens - 1) // bs  # the last token is recomputed
            hits = gpu.lookup(req.block_keys[:max_hit_blocks])
            num_local = len(hits) * bs
            num_external = 0
            if sched is not None:
                t0 = now()
                num_external = sched.lookup(req, num_local)
                kv["lookup"] += now() - t0
            n = 0 if num_external else min(req.num_tokens - num_local, budget)
            chunked = n < req.num_tokens - num_local
            need = -(-(num_local + num_external + n) // bs) - len(hits)
            gpu.touch(hits)
            if not gpu.can_allocate(need):
                gpu.free(hits[::-1])
                break
            req.blocks = hits + gpu.allocate(need)
            req.num_cached_blocks = len(hits)
            req.num_computed_tokens = num_local
            waiting.popleft()
            self.counters.num_admitted += 1
            self.counters.num_local_hit_tokens += num_local
            if sched is not None:
                t0 = now()
                sched.on_allocated(req, (req.blocks,), num_external)
                kv["on_allocated"] += now() - t0
            if num_external:
                # Its keys are registered once the load has finished (as vLLM delays
                # caching of asynchronously loaded blocks).
                req.num_computed_tokens += num_external
                self.loading[req.request_id] = req
                self.counters.num_external_hit_tokens += num_external
                self.counters.num_loads += 1
                continue
            self.running.append(req)
            scheduled.append((req, req.blocks, n, True))
            budget -= n
            if chunked and not num_external:
                self.counters.num_chunked_prefills += 1

    def _preempt(self, req: Request) -> None:
        self.gpu.free(req.blocks[::-1])
        req.blocks = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.counters.num_preemptions += 1

    def _compute(self, scheduled: list[tuple[Request, list[int], int, bool]]) -> list[Request]:
        """Advance the scheduled requests, register full blocks, sample; return finishes."""
        bs = self.config.block_size
        finished = []
        num_tokens = 0
        for req, _, n, _ in scheduled:
            num_tokens += n
            req.num_computed_tokens += n
            num_full = req.num_computed_tokens // bs
            if num_full > req.num_cached_blocks:
                self._register(req, num_full)
            if req.num_computed_tokens == len(req.token_ids):  # prefill done or decode step
                num_output = len(req.token_ids) - req.num_prompt_tokens
                req.token_ids.append(req.output[num_output])
                if len(req.token_ids) % bs == 0:
                    self._hash_last_block(req)
                if num_output + 1 >= len(req.output):
                    finished.append(req)
        self.counters.num_scheduled_tokens += num_tokens
        return finished

    def _register(self, req: Request, num_full: int) -> None:
        keys = req.block_keys
        blocks = req.blocks
        insert = self.gpu.insert_key
        bs = self.config.block_size
        for j in range(req.num_cached_blocks, num_full):
            insert(keys[j], blocks[j], bs)
        req.num_cached_blocks = num_full

    def _hash_last_block(self, req: Request) -> None:
        bs = self.config.block_size
        parent = req.block_hashes[-1] if req.block_hashes else None
        block_hash = self.hasher.hash_block(parent, req.token_ids[-bs:])
        req.block_hashes.append(block_hash)
        req.block_keys.append(make_key(block_hash, GROUP_ID))

    def _finish(self, finished: list[Request]) -> None:
        now = self.clock
        done = set(map(id, finished))
        self.running = [r for r in self.running if id(r) not in done]
        sched = self.sched
        kv = self.times.kvtier_ns
        for req in finished:
            if sched is not None:
                t0 = now()
                sched.on_finished(req, (req.blocks,))
                kv["on_finished"] += now() - t0
            self.gpu.free(req.blocks[::-1])
            req.blocks = []
            self._finished_ids.append(req.request_id)
        self.counters.num_finished += len(finished)

    def _load_done(self, req: Request) -> None:
        num_full = req.num_computed_tokens // self.config.block_size
        if num_full > req.num_cached_blocks:
            self._register(req, num_full)
        self.waiting.appendleft(req)

    def _count(self, stats: OffloadStats) -> None:
        counters = self.counters
        counters.num_stored_blocks += stats.num_stored_blocks
        counters.num_loaded_blocks += stats.num_loaded_blocks
        outcomes = counters.store_outcomes
        for name, count in stats.store_outcomes.items():
            outcomes[name] = outcomes.get(name, 0) + count
