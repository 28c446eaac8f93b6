"""The connector's scheduler role: vLLM's scheduler calls as `OffloadScheduler` calls.

Translation only; every decision is the offload scheduler's. vLLM call → kvtier call:

    bind_gpu_block_pool            bind_gpu_pool(VllmGpuPoolView)
    get_num_new_matched_tokens     lookup              (async load when > 0 tokens)
    update_state_after_alloc       on_allocated        (whole block table per group)
    build_connector_meta           build_plan          (StepInput from the SchedulerOutput)
    update_connector_output        apply_report        (WorkerReport summed over ranks)
    request_finished(_all_groups)  on_finished
    has_pending_push_work          has_pending_stores
    reset_cache                    reset
    take_events / stats            take_events / take_stats
    get_external_cache_hit_sources hit tokens per tier of the last on_allocated

With CPU and disk tiers both configured (the cascade), both tiers are sized here the way
every worker sizes them, and a request's load may be split into one job per tier.

Load failures reach vLLM through the workers, because vLLM reads `failed_recving`
from the workers' output before it calls `update_connector_output`: an issued load that
fails is reported by the workers that ran it; a load kvtier dropped before issuing it
(its request still waits for it) rides in the next step's metadata and every worker
echoes its request id as failed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence
from types import MappingProxyType
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.request import RequestStatus

from kvtier.adapters.vllm.events import EventTranslator
from kvtier.adapters.vllm.layout import (
    block_level_failures,
    bytes_per_slot,
    kv_layout,
    tier_sizes,
)
from kvtier.adapters.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.adapters.vllm.plan_memory import PlanMemory
from kvtier.adapters.vllm.scheduler_stats import SchedulerStats
from kvtier.adapters.vllm.views import VllmGpuPoolView, VllmRequestView
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier, WorkerReport
from kvtier.offload.protocols import Handoff, ScheduledRequest, StepInput, TableUpdate
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from kvtier.offload.transfers import FailedLoad

logger = logging.getLogger(__name__)

_new_tuple = tuple.__new__
_NOTHING_FINISHED = WorkerReport(done=MappingProxyType({}), failed=MappingProxyType({}))
# Plans after which a finished request is no longer suspected when a forward fails: a
# rank reports a failed forward in its next output, and vLLM keeps at most a pipeline's
# stages (or 2, overlapped) steps in flight. A bound only: every rank's output of a step,
# an empty one too, advances `PlanMemory.processed_step`, which ends the suspicion first.
_FAULT_HORIZON = 16


def _workers_heard(parallel: Any) -> int:
    """Return how many workers' outputs reach this scheduler: every rank of the engine
    (vLLM's `KVOutputAggregator` merges them), but one under an external launcher
    (torchrun's `ExecutorWithExternalLauncher`: one rank per engine, nothing aggregated,
    and a `world_size` that counts every engine's ranks). There the engines of one
    tensor/pipeline-parallel group each plan alone, on the timing of their own rank's
    copies, and would schedule different prefix hits: refused."""
    if parallel.distributed_executor_backend != "external_launcher":
        return int(parallel.world_size)
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "kvtier does not support tensor or pipeline parallelism under "
            "distributed_executor_backend='external_launcher' (tensor_parallel_size="
            f"{parallel.tensor_parallel_size}, pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}): each rank's engine would plan its "
            "prefix hits alone"
        )
    return 1


class SchedulerSide(SchedulerStats):
    """Translate one vLLM scheduler's connector calls for one `OffloadScheduler`.

    Thread affinity: vLLM's scheduler thread (engine core), like every call it receives.
    """

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        config: OffloadConfig,
        stage_layers: Sequence[int],
    ) -> None:
        """Size the tiers and build the offload scheduler.

        `stage_layers`: hidden layers per pipeline stage (`layout.tier_sizes`); this
        config is stage 0's, as vLLM gives the scheduler the first worker's.
        """
        parallel = vllm_config.parallel_config
        if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
            raise ValueError(
                "kvtier does not support context parallelism (decode_context_parallel_size="
                f"{parallel.decode_context_parallel_size}, prefill_context_parallel_size="
                f"{parallel.prefill_context_parallel_size})"
            )
        _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        self.layout = kv_layout(kv_cache_config, hash_block_size)
        self._block_level_failures = block_level_failures(kv_cache_config)
        self.tier_sizes = tier_sizes(config, kv_cache_config, stage_layers)
        self.num_tier_blocks = self.tier_sizes[config.tier]
        spec = getattr(vllm_config, "speculative_config", None)
        num_workers = _workers_heard(parallel)
        self.offload = OffloadScheduler(
            config,
            SchedulerSetup(
                self.layout,
                self.num_tier_blocks,
                num_workers=num_workers,
                num_disk_blocks=self.tier_sizes[Tier.DISK] if config.is_cascade else 0,
                # Stage 0's under pipeline parallelism: its byte counters (`stats`).
                bytes_per_slot=bytes_per_slot(kv_cache_config),
                queue_by_priority=vllm_config.scheduler_config.policy == "priority",
                # and may then preempt a request it scheduled earlier in the step
                preempts_scheduled=vllm_config.scheduler_config.policy == "priority",
                # EAGLE-style drafters: vLLM ends prefix hits a block (a hash block with
                # fine-grained hits) before the last one it matched; kvtier's end there.
                eagle_drafter=spec is not None and spec.use_eagle_block_drop(),
            ),
        )
        self._events = EventTranslator.for_vllm(kv_cache_config) if config.events else None
        self._requests: dict[str, VllmRequestView] = {}
        self._unissued_failures: list[str] = []
        self._plans = PlanMemory(self.offload.is_in_flight, num_workers)  # for faulted ranks
        self._last_step = 0  # the newest plan's step id
        # vLLM launches a step before the last one's forward ended (async scheduling, a
        # pipeline): only then may a request finish while a forward it counts may fail.
        self._overlapped = getattr(vllm_config, "max_concurrent_batches", 2) > 1
        # Requests finished while a plan built since their last step awaited its
        # outputs, by that plan's step: (step id, view, block ids) (`_unconfirm_finishes`).
        self._finished_in_flight: list[tuple[int, VllmRequestView, list[list[int]]]] = []
        self._no_new_blocks: tuple[tuple[int, ...], ...] = tuple(() for _ in self.layout.groups)
        self._last_split: tuple[str, dict[Tier, int]] | None = None
        engine = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
        self.init_stats(engine, kv_cache_config)

    # ------------------------------------------------------------------ admission

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Give the offload scheduler vLLM's GPU block pool (shared by every group)."""
        block_sizes = [group.block_size for group in self.layout.groups]
        self.offload.bind_gpu_pool(VllmGpuPoolView(gpu_block_pool, block_sizes))

    def add_request(self, request: Any) -> VllmRequestView:
        """Remember a vLLM request by id (its view is reused every step)."""
        view = self._requests.get(request.request_id)
        if view is None or view.request is not request:
            view = self._requests[request.request_id] = VllmRequestView(request)
        return view

    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Return vLLM's (external tokens, load asynchronously) for a waiting request.

        The tokens are `OffloadScheduler.offer`'s: 0 or None ("ask again later": vLLM
        skips the request this step) while requests wait to recompute after a failed
        load. That works around vLLM 0.33's bookkeeping of a failed load, which frees
        the request's blocks but keeps it at the head of `kv_holding_waiting` (its queue
        of waiting requests holding blocks, scanned first) and in `_inflight_prefills`
        (whose remaining blocks every async load admission must leave free), each until
        it is scheduled again:

        - the failed request's first lookup after the failure answers None. Its
          recompute may not fit the free blocks; vLLM's scan would stop at it, before
          the requests behind it holding blocks for their own (finished or failed)
          loads, and on a tight pool nothing would run again. Skipped, it holds no
          blocks, so vLLM requeues it in `waiting`, behind the block holders;
        - while a failed request waits to be allocated, no load is admitted beside its
          stale reservation: offered one, a request ahead of it in `waiting` would stop
          the scan there for good on a tight pool. A tier hit answers None: it waits
          for the failed request to be allocated, keeping its hit. Under vLLM's
          priority policy, a hit looked up before every waiting failed request in this
          scan (a higher-priority request) answers 0 instead and recomputes at once:
          the low-priority failed request may wait for as long as higher-priority
          requests keep the pool, and the hit with it.

        A load failed by block (`invalid_block_ids`) is held like a whole failure: where
        its first bad block is the request's first block vLLM keeps no prefix and frees
        its blocks, exactly as above. Where vLLM keeps a prefix, the request keeps its
        blocks and waits in `kv_holding_waiting` with its true reservation, like any
        loaded request; vLLM scans that queue before looking up any waiting request and
        stops there while it does not fit, so no lookup meets it unless vLLM skipped it
        (its LoRA over `max_loras`, say). There the answer is only conservative (a hit
        waits, or recomputes under the priority policy), never wrong KV; it is kept for
        one rule with the no-prefix case (`test_vllm_priority`: a kept prefix costs no hit).
        """
        view = self._requests.get(request.request_id)  # `add_request`, inlined (hot)
        if view is None or view.request is not request:
            view = self.add_request(request)
        num_tokens = self.offload.lookup(view, num_computed_tokens)
        offered = self.offload.offer(request.request_id, num_tokens)
        return offered, bool(offered)

    def on_allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Hand the request's whole block table and accepted external tokens to kvtier."""
        view = self._requests.get(request.request_id)  # `add_request`, inlined (hot)
        if view is None or view.request is not request:
            view = self.add_request(request)
        # Without external tokens (kvtier's loads are asynchronous) vLLM schedules the
        # request in this step, with this whole table: the plan notes its blocks.
        split = self.offload.on_allocated(
            view, blocks.get_block_ids(), num_external_tokens, num_external_tokens == 0
        )
        self._last_split = (
            request.request_id,
            {t: n for t, n in split.items() if n} if split else {},
        )

    def hit_split(self, request_id: str, num_tokens: int) -> dict[Tier, int] | None:
        """Return the tiers serving `request_id`'s accepted hit, by tokens, or None.

        vLLM asks right after `update_state_after_alloc` for the same request, so only
        the last allocation's split is kept (nothing to leak); None when it is another
        request's or does not add up to `num_tokens`.
        """
        last, self._last_split = self._last_split, None
        if last is None or last[0] != request_id or sum(last[1].values()) != num_tokens:
            return None
        return last[1]

    # ------------------------------------------------------------------ steps

    def build_metadata(self, scheduler_output: Any) -> KVTierMetadata:
        """Return this step's plan, with never-issued loads for the workers to fail."""
        self._take_unissued_failures()
        scheduled = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        requests, no_new_blocks = self._requests, self._no_new_blocks
        replace, append = TableUpdate.REPLACE, TableUpdate.APPEND
        for req_id, block_ids, is_full_table in yield_req_data(scheduler_output):
            view = requests.get(req_id)
            if view is None:
                continue  # not admitted through this connector (cannot happen in vLLM)
            # vLLM's lists pass as they are: kvtier copies them into its table at once.
            ids = no_new_blocks if block_ids is None else block_ids
            update = replace if is_full_table else append
            # `ScheduledRequest(...)` goes through the NamedTuple's Python `__new__`:
            # built directly, one per running request costs 0.2 µs less.
            scheduled.append(
                _new_tuple(ScheduledRequest, (view, ids, num_scheduled[req_id], update))
            )
        plan = self.offload.build_plan(
            StepInput(
                scheduled=tuple(scheduled),
                finished_request_ids=frozenset(scheduler_output.finished_req_ids),
                preempted_request_ids=frozenset(scheduler_output.preempted_req_ids or ()),
                handoffs=_handoffs(scheduler_output),
            )
        )
        failed, self._unissued_failures = tuple(self._unissued_failures), []
        self._last_step = last = plan.step_id
        finished = self._finished_in_flight
        if finished and finished[0][0] <= last - _FAULT_HORIZON:  # bounded, oldest first
            self._finished_in_flight = [f for f in finished if f[0] > last - _FAULT_HORIZON]
        return self._plans.metadata(plan, failed)

    def apply_output(self, connector_output: Any) -> None:
        """Apply the workers' merged report: register stores, release load pins."""
        self._take_unissued_failures()
        worker_meta = connector_output.kv_connector_worker_meta
        if worker_meta is None:
            report = _NOTHING_FINISHED
        elif isinstance(worker_meta, KVTierWorkerMetadata):
            report = worker_meta.report
        else:
            raise TypeError(f"unexpected worker metadata {type(worker_meta).__name__}")
        plans = self._plans
        fault_step = plans.fault_step
        plans.applied(worker_meta, connector_output)  # corrects its `finished_recving`
        if self._finished_in_flight:
            if plans.fault_step > fault_step:
                self._unconfirm_finishes()
            else:  # their forwards all ran
                done = plans.processed_step
                self._finished_in_flight = [f for f in self._finished_in_flight if f[0] > done]
        outcome = self.offload.apply_report(report)
        for failed in outcome.failed_loads:  # issued: the workers reported them to vLLM
            logger.warning(
                "kvtier load of tokens [%d, %d) for request %s failed on a worker; vLLM "
                "recomputes %s (kv_load_failure_policy='recompute')",
                failed.start_token,
                failed.end_token,
                failed.request_id,
                self._recomputed(failed),
            )

    def _recomputed(self, failed: FailedLoad) -> str:
        """Say what vLLM recomputes for a failed load, as the workers report it: by GPU
        block (`invalid_block_ids`) only where every bad block was named and the layout
        takes errors by block; else the request failed whole (`failed_recving`)."""
        if failed.whole or not self._block_level_failures:
            return "every token after its own GPU prefix-cache hit (the load failed whole)"
        return "from the first block not loaded whole (the bad blocks were named)"

    def _take_unissued_failures(self) -> None:
        """Collect loads kvtier dropped before issuing them (an empty report drains them)."""
        if not self.offload.has_unissued_failures():
            return  # the common step: skip building an empty report's outcome
        failed_loads = self.offload.apply_report(_NOTHING_FINISHED).failed_loads
        for failed in failed_loads:
            logger.warning(
                "kvtier dropped the load of request %s before issuing it; it will be "
                "reported as failed",
                failed.request_id,
            )
            self._unissued_failures.append(failed.request_id)

    def on_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> None:
        """Let kvtier flush the finished request's blocks, then forget the request.

        Under vLLM's fault tolerance (`enable_fault_tolerance`) a forward that raises
        still counts its scheduled tokens in `num_computed_tokens` (vLLM advances it when
        it schedules), and the engine core aborts every request from the exception
        handler of its busy loop (`fault_tolerant_wrapper` → `EngineCoreSentinel.on_fault`)
        without any output of that step. An abort seen while an exception is being
        handled is that one: kvtier is told the request's compute is unconfirmed.

        A load allocated but not yet issued is dropped, and echoed as never issued: vLLM
        frees a request waiting for its load only once the load is reported. (An abort
        lands there when vLLM defers `update_state_after_alloc` to `update_from_output`:
        `defer_async_loads`, overlapped steps with HiSparse.)
        """
        fault = request.status == RequestStatus.FINISHED_ABORTED and sys.exc_info()[1] is not None
        view = self._requests.get(request.request_id)  # `add_request`, inlined (hot)
        if view is None or view.request is not request:
            view = self.add_request(request)
        if fault and self._finished_in_flight:
            self._unconfirm_finishes()
        if self.offload.on_finished(view, block_ids, computed=not fault):
            self._unissued_failures.append(request.request_id)
        del self._requests[request.request_id]
        if not fault and self._overlapped and self._last_step > self._plans.processed_step:
            tables = [list(ids) for ids in block_ids]
            self._finished_in_flight.append((self._last_step, view, tables))

    def _unconfirm_finishes(self) -> None:
        """A forward failed: the requests that finished while a plan was in flight may
        have counted its compute (vLLM: a user's abort between scheduling a step and
        learning that its forward failed, with steps overlapped): take their finishes as
        unconfirmed (`OffloadScheduler.unconfirm_finished`), a lost store at worst."""
        for _, view, tables in self._finished_in_flight:
            self.offload.unconfirm_finished(view, tables)
        self._finished_in_flight = []

    def has_pending_stores(self) -> bool:
        """Return True while stores are queued or in flight (vLLM keeps stepping)."""
        return self.offload.has_pending_stores()

    def has_pending_block_frees(self) -> bool:
        """Return True when a transfer holds the last reference on a GPU block (it comes
        back to vLLM's pool once the transfer is reported)."""
        return self.offload.holds_gpu_blocks_alone()

    def reset(self) -> bool:
        """Drop the tier's contents; False while issued transfers are outstanding."""
        done = self.offload.reset()
        self._take_unissued_failures()
        return done

    # ------------------------------------------------------------------ observability

    def take_events(self) -> list[Any]:
        """Return this step's tier events as vLLM KV events (none when events are off)."""
        if self._events is None:
            return []
        return self._events.translate_all(self.offload.take_events())

    @property
    def num_tracked_requests(self) -> int:
        """Return how many live requests the connector remembers (tests: no leaks)."""
        return len(self._requests)


def _handoffs(scheduler_output: Any) -> tuple[Handoff, ...]:
    """Return vLLM's exact-block state hand-offs (Mamba "align") as kvtier hand-offs."""
    state = scheduler_output.kv_connector_block_state
    offers: dict[str, Iterable[tuple[int, int, int]]] = (
        state.boundary_state_offloads if state is not None else {}
    )
    return tuple(
        Handoff(req_id, group_id, gpu_block_id)
        for req_id, items in offers.items()
        for group_id, gpu_block_id, _ in items
    )
