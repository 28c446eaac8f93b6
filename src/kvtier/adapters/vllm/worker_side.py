"""The connector's worker role: vLLM's model-runner calls as `OffloadWorker` calls.

Per step, in vLLM's order:

    handle_preemptions     flush() when the plan says a request was preempted
    bind metadata          remember the plan; the load-event → request-id map
    start_load_kv          submit the plan's load jobs (right after the forward launch)
                           and its CPU → DISK demotions (cascade; no GPU memory touched)
    wait_for_save          record the compute-done marker, submit the store jobs
    get_transfer_results   poll(): requests whose every load event finished →
                           finished_recving; those with a failed event (only those
                           reading a bad block, when the worker named the event's bad
                           blocks), and the scheduler's never-issued ones →
                           failed_recving too; with one full-attention group, a
                           request whose failures all named their bad blocks is
                           finished instead, and
    load errors            the GPU blocks its bad blocks were copied into
                           (`get_block_ids_with_load_errors`): vLLM keeps its prefix
    worker metadata        the polled `WorkerReport` for the scheduler role, and the
                           numbers of this rank's outputs until the scheduler role
                           acknowledges them: an output vLLM dropped (the rank raised
                           after these calls) is sent again once (`redelivery`)

A forward that raises (vLLM's fault tolerance keeps the engine up) still gets
`start_load_kv`, `wait_for_save` and the result calls from Model Runner V1's `finally`,
whose output vLLM drops: then nothing is polled. Model Runner V2 (vLLM 0.33's default)
calls nothing more after `pre_forward` (`handle_preemptions`, bind, synchronous loads):
the next bind finds the plan's results never taken and fails the jobs it never
submitted. With a speculative config both runners call `wait_for_save` after the
drafter's forward (which writes the draft layers' KV), past the result calls: a drafter
that raises skips it, and the next bind takes that step as a failed forward too. (V1
defers it on every pipeline stage, but only the last, the drafter's, ever calls it: an
earlier stage submits its stores in `get_transfer_results` instead.) In
every case the stores of every plan built before the scheduler role learned of the
failure (`KVTierMetadata.fault_step`) are reported failed.

The worker holds no policy and never blocks except in `flush()`. With the CPU+disk
cascade a request's load may be split into one event per tier; `LoadTracker` reports
the request once all of them finished. What the result calls and the worker metadata
hand vLLM, and the failed forward's step, are `worker_results`'s (`WorkerResults`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvtier.adapters.vllm.layout import block_level_failures, bytes_per_slot, tier_sizes
from kvtier.adapters.vllm.load_tracker import LoadTracker
from kvtier.adapters.vllm.metadata import KVTierMetadata
from kvtier.adapters.vllm.redelivery import Outbox, Output
from kvtier.adapters.vllm.regions import KVCacheValue, placement_block_views
from kvtier.adapters.vllm.worker_results import WorkerResults
from kvtier.offload.config import OffloadConfig
from kvtier.offload.host import remove_created_directory
from kvtier.offload.plan import Tier, TransferPlan, WorkerReport
from kvtier.transfer.regions import TensorLayout
from kvtier.transfer.worker import OffloadWorker, WorkerConfig

logger = logging.getLogger(__name__)


def worker_config(config: OffloadConfig, sizes: Mapping[Tier, int], rank: int) -> WorkerConfig:
    """Return the `WorkerConfig` of one rank: `sizes[tier]` slots of each configured tier."""
    if Tier.DISK not in sizes:
        return WorkerConfig(cpu_num_slots=sizes[Tier.CPU], rank=rank)
    return WorkerConfig(
        cpu_num_slots=sizes.get(Tier.CPU, 0),
        disk_num_slots=sizes[Tier.DISK],
        disk_path=config.disk_path,
        disk_io_mode=config.disk_io_mode,
        disk_buffer_slots=config.disk_buffer_slots,
        rank=rank,
    )


def distributed_rank() -> int | None:
    """Return this process's rank in vLLM's world group, or None before it exists.

    vLLM makes it global: with data parallelism (or several nodes) the data-parallel rank
    is already folded in (`init_distributed_environment`), so it is unique per worker.
    """
    from vllm.distributed import parallel_state

    try:
        world = parallel_state.get_world_group()
    except AssertionError:  # "world group is not initialized" (single-process tests)
        return None
    return None if world is None else int(world.rank)


def last_pipeline_stage() -> bool:
    """Return whether this rank is in vLLM's last pipeline stage (True without vLLM's
    distributed state: one process)."""
    from vllm.distributed import parallel_state

    try:
        return bool(parallel_state.get_pp_group().is_last_rank)
    except AssertionError:  # "pipeline model parallel group is not initialized"
        return True


def file_rank(device_index: int | None) -> int:
    """Return the number in this worker's tier file names (`kvtier-rank{N}.slots`).

    It must differ between every worker process that may share a disk path: vLLM's global
    rank (unique across tensor, pipeline and data parallelism whatever
    `CUDA_VISIBLE_DEVICES` says) or, without vLLM's distributed state (one process), the
    device index.
    """
    rank = distributed_rank()
    return (device_index or 0) if rank is None else rank


class WorkerSide(WorkerResults):
    """Drive one rank's `OffloadWorker` from vLLM's worker-role connector calls.

    Thread affinity: the model runner's thread. The worker's copies run on its own lanes.
    """

    def __init__(
        self,
        kv_cache_config: Any,
        config: OffloadConfig,
        layout_name: str | None,
        stage_layers: Sequence[int],
    ):
        """Size this rank's tiers exactly as the scheduler role sizes them.

        `stage_layers`: hidden layers per pipeline stage (`layout.tier_sizes`). Raises
        at start-up when this rank's blocks cannot be stored as configured, or this
        machine cannot hold the tiers (`OffloadConfig.prepare_host`: memory, `disk_path`).
        """
        self.config = config
        self.tier_sizes = tier_sizes(config, kv_cache_config, stage_layers)
        # This rank's machine holds its tiers, not the scheduler's. A directory this
        # made goes again if the worker never starts (`_remove_created_directory`).
        self._created_directory = config.prepare_host()
        self.num_tier_blocks = self.tier_sizes[config.tier]
        self._slot_bytes = bytes_per_slot(kv_cache_config)  # what `tier_sizes` sized for
        self._kv_cache_config = kv_cache_config
        self._layout_name = layout_name
        self._worker: OffloadWorker | None = None
        self._plan: TransferPlan | None = None
        self._echo_failed: tuple[str, ...] = ()
        self._loads_submitted = False
        self._stores_submitted = False
        self._results_taken = False  # `take_results` ran since the plan was bound
        self.loads = LoadTracker(block_level=block_level_failures(kv_cache_config))
        self._report = WorkerReport()
        self._held_failures = WorkerReport()  # of refused plans (`_fail_unsubmitted`)
        self._plan_fault_step = 0  # `KVTierMetadata.fault_step` of the bound plan
        self._failed_step: int | None = None  # of the newest plan whose forward failed here
        self._last_step_id = 0  # `TransferPlan.step_id` of the last bound plan (from 1)
        self.outbox = Outbox()  # outputs until acknowledged (`redelivery`)
        self._resend: Output | None = None  # dropped outputs, sent again this step
        self._output = Output(0)  # what this step's output carries so far, resends aside
        self._handed: frozenset[str] = frozenset()  # `finished_recving` of this output
        # An earlier pipeline stage runs no drafter, but Model Runner V1 still defers its
        # `wait_for_save` when speculating, to a finalize only the last stage calls.
        self._saves_with_results = bool(stage_layers) and not last_pipeline_stage()

    @property
    def worker(self) -> OffloadWorker:
        """Return the offload worker; raises before `register_kv_caches`."""
        if self._worker is None:
            raise RuntimeError("kvtier worker has no KV caches yet: register_kv_caches first")
        return self._worker

    def register_kv_caches(self, kv_caches: Mapping[str, KVCacheValue]) -> None:
        """Address vLLM's KV allocation by block id and allocate this rank's tier."""
        if self._worker is not None:
            raise RuntimeError("register_kv_caches called twice")
        worker = None
        try:
            views = placement_block_views(self._kv_cache_config, kv_caches, self._layout_name)
            device = next(iter(views.values())).device
            rank = file_rank(device.index)
            worker = OffloadWorker(worker_config(self.config, self.tier_sizes, rank))
            worker.register(views, TensorLayout.BLOCKS_FIRST)
            self._check_slot_bytes(worker.bytes_per_slot)
        except BaseException:
            if worker is not None:
                with contextlib.suppress(Exception):  # the start's error is the one to see
                    worker.shutdown()
            self._remove_created_directory()
            raise
        self._worker = worker
        logger.info(
            "kvtier worker on %s: %s slots of %d B",
            device,
            ", ".join(f"{n} {tier.value}" for tier, n in self.tier_sizes.items()),
            worker.bytes_per_slot,
        )

    def _check_slot_bytes(self, registered: int) -> None:
        """Raise when the worker's regions hold other bytes per block id than the tiers
        were sized for: the tiers would overrun their budget (or waste it), and the
        direct-I/O check and the scheduler role's byte counters would be off."""
        if registered != self._slot_bytes:
            raise RuntimeError(
                f"kvtier's worker regions hold {registered} B per KV block id, but its tiers "
                f"were sized for {self._slot_bytes} B (layout.bytes_per_slot of this rank's "
                "KVCacheConfig): a kvtier bug; please report it with the KVCacheConfig "
                "(kv_cache_groups, kv_cache_tensors) and the KV cache layout"
            )

    # ------------------------------------------------------------------ step

    def handle_preemptions(self, metadata: KVTierMetadata) -> None:
        """Finish every outstanding transfer when a preempted request's blocks may be reused."""
        if metadata.plan.need_flush:
            self.worker.flush()

    def bind(self, metadata: KVTierMetadata) -> None:
        """Take this step's plan; its load map covers every outstanding load event.

        Jobs of the previous plan never submitted are reported failed: its stores when
        vLLM deferred `wait_for_save` past a drafter's forward that raised (speculative
        decoding), all of them when its forward raised under Model Runner V2, which
        calls nothing after `pre_forward` then. Either way that plan's step counts as a
        failed forward's, as below: a raising drafter left the draft layers' KV of the
        step's positions unwritten, though the step's results were taken. A plan
        skipped (vLLM's model runner raised before binding it, in `_update_states` or
        `_prepare_inputs`; plans are numbered from 1, so the first may be the one)
        counts as a failed forward of the newest skipped step: a plan built before the
        fault was known (this one, unless its `fault_step` says otherwise) stores that
        step's unwritten blocks. The skipped plans' jobs never ran here and never will:
        their events still in flight (`KVTierMetadata.earlier_events`) are reported
        failed, so their pins are released and their loads' requests fail (vLLM
        recomputes them, or frees an aborted one), and the loads they echoed as never
        issued are echoed now (`earlier_echoes`).
        """
        previous = self._plan
        if previous is not None:
            if not (self._results_taken and self._stores_submitted):
                # Model Runner V2 (vLLM 0.33's default) calls nothing after `pre_forward`
                # when the forward raises, and either runner skips the deferred
                # `wait_for_save` when the drafter raises: the fault is noted here, as
                # `_note_failed_forward` does under V1's `finally`, and the jobs never
                # submitted fail below.
                self._note_failed_step(previous.step_id)
            self._hold_failures(self._unsubmitted(previous))
            self._plan = None  # its jobs are failed or submitted: never again
        # What may raise comes first (no step of vLLM makes it raise, but a MemoryError
        # may come from any call): a bind cut short leaves this plan unbound, as one vLLM
        # skipped, and the next bind fails its jobs. Bound, it would pass for one that ran
        # here: its jobs never failed, its step's unwritten blocks stored by later plans.
        plan = replace(metadata.plan, need_flush=False)  # flushed in handle_preemptions
        last, step_id = self._last_step_id, plan.step_id
        skipped_events: tuple[int, ...] = ()
        skipped_echoes: tuple[str, ...] = ()
        if step_id > last + 1:  # vLLM raised before binding a plan: its forward never ran here
            earlier = metadata.earlier_events.items()
            skipped_events = tuple(e for s, events in earlier if last < s < step_id for e in events)
            echoes = metadata.earlier_echoes.items()
            skipped_echoes = tuple(r for s, ids in echoes if last < s < step_id for r in ids)
        resend = self.outbox.acknowledge(metadata.acks, metadata.processed_step)
        self.loads.update(plan.load_request_ids, (job for job in plan.jobs if job.is_load))
        # Bound from here on; nothing below raises.
        if step_id > last + 1:
            self._note_failed_step(step_id - 1)
            self._hold_failures(skipped_events)
            self._echo_failed += skipped_echoes
        # Kept until `take_results` hands them to vLLM: not in a step whose forward raised.
        self._echo_failed += metadata.unissued_failed_request_ids
        self._resend = resend
        self._plan = plan
        self._plan_fault_step = metadata.fault_step
        self._last_step_id = max(last, step_id)
        self._loads_submitted = self._stores_submitted = self._results_taken = False

    def take_results(self) -> tuple[set[str], set[str]]:
        """As `WorkerResults.take_results`; on an earlier pipeline stage submit the
        stores first, as `wait_for_save` would have right before (the stage writes no
        KV after its forward: the drafter runs on the last stage only)."""
        if self._saves_with_results:
            self.submit_stores()
        return super().take_results()

    def _unsubmitted(self, plan: TransferPlan) -> Iterator[int]:
        """Yield the events of the bound `plan`'s jobs never handed to the worker."""
        for job in plan.jobs:
            if not (self._stores_submitted if job.is_store else self._loads_submitted):
                yield job.event_id

    def clear(self) -> None:
        """Forget this step's plan."""
        self._plan = None

    def start_loads(self) -> None:
        """Submit this step's loads and demotions (they run in the background).

        Demotions (CPU → DISK) read only the CPU tier, whose source blocks the scheduler
        pinned once their stores had completed: they need not wait for the forward.
        The plan's `end_persistence` and `forget_slots` go with this submit, before any
        job of the plan, even when it has no load or demotion (a plan with nothing at
        all submits nothing).

        A submit that raises fails the plan's events the worker never started
        (`_fail_unsubmitted`) and propagates.
        """
        plan = self._plan
        if plan is None or self._loads_submitted:
            return
        self._loads_submitted = True
        jobs = tuple(job for job in plan.jobs if not job.is_store)
        if jobs or plan.forget_slots or plan.end_persistence:
            try:
                self._submit(replace(plan, jobs=jobs))
            except BaseException:
                # vLLM calls no wait_for_save after this: the stores fail with the loads.
                self._stores_submitted = True
                self._hold_failures(job.event_id for job in plan.jobs if job.is_store)
                raise

    def submit_stores(self) -> None:
        """Submit this step's stores after the forward that wrote their blocks.

        Loads are submitted too if `start_loads` was not called this step. A plan built
        before the scheduler role learned of a forward that failed on this rank
        (`_stores_unsafe`) may store blocks that forward never wrote: its stores are
        reported failed instead. So are the stores of a forward that raised (vLLM calls
        this from a `finally`): a block one request computes in that very step may be
        another's local hit, whose store this plan carries.
        """
        if self._plan is None or self._stores_submitted:
            return
        self.start_loads()
        self._stores_submitted = True
        jobs = tuple(job for job in self._plan.jobs if job.is_store)
        self._note_failed_forward()
        if jobs and self._stores_unsafe:
            self._hold_failures(job.event_id for job in jobs)
        elif jobs:  # the plan's manifest drops went with the loads (`start_loads`)
            self.worker.record_compute_done()
            self._submit(replace(self._plan, jobs=jobs, forget_slots=(), end_persistence=False))

    def _submit(self, plan: TransferPlan) -> None:
        """Hand `plan` to the worker; if it raises, fail what it never started."""
        try:
            self.worker.submit(plan)
        except BaseException:
            self._fail_unsubmitted(plan)
            raise

    def _fail_unsubmitted(self, plan: TransferPlan) -> None:
        """Report as failed, at the next `take_results`, the events of a refused `plan`
        the worker never started, as the reference engine does (`OffloadSide.submit`).

        vLLM's engine survives the error under its fault tolerance
        (`enable_fault_tolerance`: every request aborted, the same connector resumed);
        unreported, the events would keep their pins and the scheduler's pending stores
        for good. What the worker started ends first (`flush`), so no event is failed
        while its copy still runs; if that flush fails too, nothing is failed (a copy
        may still write the GPU blocks). The plans carry no manifest work to requeue:
        the connector refuses `disk_persist`.
        """
        try:
            self.worker.flush()
            started = self.worker.peek()
        except Exception:
            logger.exception("kvtier worker: flush after a refused plan failed")
            return
        reported = {*started.done, *started.failed}
        self._hold_failures(job.event_id for job in plan.jobs if job.event_id not in reported)

    def shutdown(self) -> None:
        """Finish outstanding transfers and release the tier (idempotent)."""
        if self._worker is None:  # never started: vLLM failed before registering
            self._remove_created_directory()
        else:
            self._worker.shutdown()

    def _remove_created_directory(self) -> None:
        """Remove the `disk_path` directory `prepare_host` made, if still empty: a worker
        that never started leaves nothing behind (once; never raises)."""
        remove_created_directory(self._created_directory)
        self._created_directory = None
