"""The reference engine's scheduler: continuous batching over a paged GPU cache.

Each step it first continues running requests (decode, or the next prefill chunk),
preempting the newest when the GPU pool runs out (unless a transfer is about to give
blocks back: then the step waits for them, `_frees_pending`), then admits waiting requests in FCFS
order within the token budget (a request's admission is `admission`'s). All GPU blocks
come from one `BlockPool` shared by every KV group.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from kvtier.core.block_pool import BlockPool
from kvtier.core.kv_groups import KVLayout
from kvtier.engine.admission import Admission
from kvtier.engine.block_cache import cache_full_blocks, drop_out_of_window
from kvtier.engine.load_failure import rewind
from kvtier.engine.queue_recovery import QueueRecovery
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import FinishReason, finish_reason
from kvtier.engine.scheduler_step import ScheduledWork, SchedulerLimits, SchedulerStep
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.offload.transfers import FailedLoad, ReportOutcome

logger = logging.getLogger(__name__)

__all__ = ["ScheduledWork", "Scheduler", "SchedulerLimits", "SchedulerStep"]


class Scheduler(QueueRecovery, Admission):
    """Decide each step which requests run, with how many tokens and which blocks."""

    def __init__(
        self,
        layout: KVLayout,
        pool: BlockPool,
        limits: SchedulerLimits,
        offload: OffloadScheduler | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.layout = layout
        self.eos_token_ids = eos_token_ids
        self.pool = pool
        self.limits = limits
        self.offload = offload
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.num_preemptions = 0  # running requests preempted
        self.num_idle_releases = 0  # waiting requests whose idle blocks were freed
        self._unfreed = []
        self._aborting: dict[str, Request] = {}
        # Finished by `complete`, not yet returned by the engine's step: kept in the
        # statement that finishes them, so a step cut short loses none (`LLM.step`).
        self.unreturned: list[Request] = []
        # Finished, their hit tokens not yet counted by the engine (`LLM._count_finished`):
        # kept in the same statement, so a step cut short after finishing them counts them
        # at the next.
        self.uncounted: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue a new request."""
        request.block_tables = [[] for _ in self.layout.groups]
        self.waiting.append(request)

    def holds(self, request: Request) -> bool:
        """Return True when `request` is this scheduler's and unfinished."""
        if self.loading.get(request.request_id) is request:
            return True
        return request in self.running or request in self.waiting

    def has_unfinished(self) -> bool:
        """Return True while any request is waiting, loading or running; one whose abort
        an interrupt cut short counts until `end_aborts` (or the next step) ends it."""
        return bool(self.waiting or self.running or self.loading)

    def abort(self, request: Request) -> None:
        """Drop an unfinished request: free its GPU blocks and its offload state.

        Its transfers already issued keep their own pins until the worker reports them
        (SPEC §6.7); a load finishing later is ignored. A finished request is left as is.

        Against an interrupt (Ctrl-C): noted in `_aborting` first, it stays in its queues
        until it is FINISHED, so a retry finds it, and the next `_settle` ends an abort
        cut short if no retry comes (the request never runs on without its blocks). Its
        offload state and blocks go first (both safe to repeat), then it is FINISHED,
        and it leaves its queues and `_aborting` last.
        """
        if request.status is not RequestStatus.FINISHED:
            self._aborting[request.request_id] = request
            if self.offload is not None:
                self.offload.on_finished(request, request.block_tables)
            self._free_blocks(request)
            request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
        if self._aborting.get(request.request_id) is not request:
            return  # finished otherwise (or its abort ended already)
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.loading.pop(request.request_id, None)
        del self._aborting[request.request_id]

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerStep:
        """Choose this step's work. `num_computed_tokens` is advanced by `complete`."""
        self._settle()
        step = SchedulerStep()
        budget = self.limits.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_ids = self._grow(request, num_new)
            if new_ids is None and self._frees_pending():
                step.waits_for_frees = True  # this and later running requests wait
                break
            while new_ids is None and self.running[-1] is not request:
                self._preempt(self.running[-1], step)
                new_ids = self._grow(request, num_new)
            if new_ids is None and self._release_idle_blocks(step, list(self.waiting)):
                new_ids = self._grow(request, num_new)
            if new_ids is None:  # the last one running and still short: a smaller chunk
                shrunk = self._shrink_to_fit(request, num_new)
                if shrunk is not None:
                    num_new, new_ids = shrunk, self._grow(request, shrunk)
            if new_ids is None and self._holds_the_pool(request):
                step.stuck = request
                return step
            if new_ids is None:
                self._preempt(request, step)  # the last one running
                break
            step.work.append(self._work(request, num_new, new_ids))
            budget -= num_new
            index += 1
        num_preempted = len(step.preempted_ids)
        while (
            self.waiting
            and budget > 0
            and len(step.preempted_ids) == num_preempted
            and not step.waits_for_frees  # the blocks coming back are the running ones'
        ):
            if len(self.running) >= self.limits.max_num_seqs:
                break
            request = self.waiting[0]
            admitted = self._admit(request, budget)
            if (
                admitted is None
                and not self.running
                and self._release_idle_blocks(step, list(self.waiting)[1:])
            ):
                admitted = self._admit(request, budget)
            if admitted is None and not self.running:  # alone: a smaller first chunk
                admitted = self._admit(request, budget, shrink=True)
            if admitted is None:
                break  # no room on the GPU: wait for blocks to free up
            num_new = admitted
            # In its new queue first, out of `waiting` last (`_settle`).
            if request.status is RequestStatus.WAITING_FOR_LOAD:
                self.loading[request.request_id] = request
                self.waiting.popleft()
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.waiting.popleft()
            new_ids = self._grow(request, num_new)
            assert new_ids is not None, "admission reserved these blocks"
            step.work.append(self._work(request, num_new, new_ids))
            budget -= num_new
        return step

    def _release_idle_blocks(self, step: SchedulerStep, requests: Sequence[Request]) -> bool:
        """Free the blocks that the waiting `requests` hold; return True if any had some.

        Requests back from a load hold blocks while they wait. When nothing runs and the
        head does not fit, or the last running request cannot grow, they would wait for
        each other forever: the running one would preempt itself, be admitted again with
        the same chunk, and fail to grow again. Their KV stays cached in the pool, so
        they find it again as a local hit. Counted apart from preemptions (nothing ran
        them), they are in `step.preempted_ids` too: the offload side drops their tables.
        """
        released = False
        for request in requests:
            if any(request.block_tables):
                self._drop_kv(request)
                step.preempted_ids.add(request.request_id)
                step.released_ids.add(request.request_id)
                self.num_idle_releases += 1
                released = True
        return released

    def _preempt(self, request: Request, step: SchedulerStep) -> None:
        """Move the last running request to the front of `waiting`, then free its blocks.

        Against an interrupt: it moves with its blocks and computed tokens (cut short
        there, it resumes from them as a request back from a load does), is in `waiting`
        before it leaves `running` (`_settle`), and drops its KV in one statement before
        its blocks are freed (cut short in the frees, `_settle` frees the rest).
        """
        logger.debug("preempting %s", request.request_id)
        assert self.running[-1] is request
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.running.pop()
        self._drop_kv(request)
        step.preempted_ids.add(request.request_id)
        self.num_preemptions += 1

    def _drop_kv(self, request: Request) -> None:
        """Free a request's blocks: it computes again from scratch, its table sent whole.

        `needs_full_table` first (a table sent whole is right for one kept, too), then its
        tables and computed tokens go in one statement: an interrupt never leaves it
        counting tokens it holds no blocks for (it would attend to other KV)."""
        request.needs_full_table = True
        self._unfreed, request.block_tables, request.num_computed_tokens = (
            [*self._unfreed, *request.block_tables],
            [[] for _ in self.layout.groups],
            0,
        )
        self._free_unfreed()

    # ------------------------------------------------------------------ results

    def complete(
        self, step: SchedulerStep, sampled: Sequence[int | None], now: float
    ) -> list[Request]:
        """Apply a computed step: advance counts, cache full blocks, append tokens, finish.

        `sampled[i]` is the token sampled for `step.work[i]` (None for a prefill chunk
        that did not reach the end of its tokens). Returns the requests that finished.
        """
        finished = []
        for work, token in zip(step.work, sampled, strict=True):
            request = work.request
            request.has_unconfirmed_work = False  # its tables reached the offload side
            before = request.num_computed_tokens
            request.num_computed_tokens += work.num_new_tokens
            cache_full_blocks(self.layout, self.pool, request, before)
            if token is None:  # a prefill chunk: the next one attends to a window too
                self._drop_out_of_window(request)
                continue
            request.append_output(token, now)
            reason = finish_reason(
                token,
                len(request.output_token_ids),
                request.params,
                self.eos_token_ids,
                num_tokens=request.num_tokens,
                max_model_len=self.limits.max_model_len,
            )
            if reason is not None:
                request.finish_reason = reason
                self._finish(request, now)
                finished.append(request)
            else:
                self._drop_out_of_window(request)
        return finished

    def _drop_out_of_window(self, request: Request) -> None:
        """Free the sliding-window blocks the request no longer attends to; cut short,
        `_settle` (or the step's abort) frees those taken from its table."""
        drop_out_of_window(self.layout, request, self._unfreed)
        if self._unfreed:  # none for a model without sliding windows
            self._free_unfreed()

    def _finish(self, request: Request, now: float) -> None:
        """Its offload state and blocks go first, `running` next, and it is FINISHED last:
        cut short (an interrupt), it is still unfinished, and the step's abort finishes
        what is left (`abort` skips a FINISHED request: one still running would run on).
        Marked FINISHED, it is `unreturned` and `uncounted` in the same statement."""
        if self.offload is not None:
            self.offload.on_finished(request, request.block_tables)
        self._free_blocks(request)
        self.running.remove(request)
        request.status, request.finish_time, self.unreturned, self.uncounted = (
            RequestStatus.FINISHED,
            now,
            [*self.unreturned, request],
            [*self.uncounted, request],
        )

    def apply_offload(self, outcome: ReportOutcome) -> None:
        """Make requests whose load finished schedulable; rewind those whose load failed.
        They go to the front of `waiting` in the order they were admitted (fairness).

        Safe to repeat with the same outcome, as the engine does when a call was cut short
        (KeyboardInterrupt), before it schedules again: a request leaves `loading` last,
        once it is queued again, and one not loading (finished, aborted, or applied
        already) is ignored; a move an interrupt cut short is finished first (`_settle`). A
        repeat must come before `schedule` could admit a request anew: its next load's
        outcome is not this one.
        """
        self._settle()  # before `_resume` queues a request in front of the one caught
        finished = set(outcome.finished_loads)  # a request both finished and failed: finished
        failures: dict[str, FailedLoad] = {}
        for failed in outcome.failed_loads:
            failures.setdefault(failed.request_id, failed)  # its first failure counts
        back = [r for i, r in self.loading.items() if i in finished or i in failures]
        # Each goes to the front of `waiting`, the last admitted first: they end up in the
        # order they were admitted (their queue order), whatever order the report gives.
        # Cut short, a repeat queues those still loading in front of those queued.
        for request in reversed(back):
            request_id = request.request_id
            keeps_blocks = request_id in finished
            if not keeps_blocks:  # rewound; the blocks of the tokens it keeps stand
                suspects = outcome.suspect_gpu_blocks.get(request_id)
                keeps_blocks = rewind(self.layout, request, failures[request_id], suspects) > 0
            if keeps_blocks:
                cache_full_blocks(self.layout, self.pool, request, 0)
            else:  # recompute from scratch
                self._free_blocks(request)
            self._resume(request)
