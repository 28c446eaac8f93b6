"""The offload worker: executes transfer plans and reports finished events (SPEC §7).

The worker owns the bytes — the engine's KV regions, the host tier, the disk tier — and
no policy: the scheduler decides what moves where, the worker moves it and says when.

Jobs by tier pair and the lane (background thread, FIFO) that runs them (see `routes`):

    GPU → CPU    store    host tier          CPU → GPU    load     host tier
    GPU → DISK   store    disk via staging   DISK → GPU   load     disk via staging
    CPU → DISK   store    demote             DISK → CPU   load     promote

Ordering on CUDA: a store must not read a GPU block before the forward pass that writes
it. `submit()` records a compute-done event on the caller's current stream (call it right
after launching the forward) unless `record_compute_done()` was called since the previous
submit; the store stream waits on that event before reading. Loads do not wait: their
destination blocks are not used until the load is reported done, and the engine must not
give a load blocks that a forward still queued may write. vLLM 0.33 guarantees that: with
overlapping steps (asynchronous scheduling, pipeline parallelism) its scheduler defers
freeing a finished request's blocks for a KV-consuming connector until every step that
may write them has completed; a synchronous engine's earlier forwards have finished.

Persistent disk tier (`WorkerConfig.disk_persist`, see `kvtier.storage.manifest`): a job
into DISK drops the slots' earlier records first, and with `dst_records` records each slot
once its data is written; a failed write leaves none. `recovered_slots()`
lists what the previous run left (never slot 0, the pool's null block). A plan with
`end_persistence` (every plan after a tier reset) drops every record before its jobs
start, and nothing is recorded for the rest of the run. A plan's `forget_slots` (copies
the scheduler dropped or never registered) lose their records before its jobs start.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType

import numpy as np
import torch

from kvtier.offload.plan import SlotRecord, Tier, TransferJob, TransferPlan
from kvtier.storage.disk_tier import DiskTier, DiskTierConfig
from kvtier.storage.slot_file import FileIO
from kvtier.transfer.block_copy import row_dtype
from kvtier.transfer.copiers import CpuCopier, CudaCopier
from kvtier.transfer.device import pin_host_memory, record_compute_marker
from kvtier.transfer.disk_mover import DiskMover
from kvtier.transfer.host_tier import HostTier
from kvtier.transfer.job_checks import (
    block_id_array,
    check_counts,
    check_distinct,
    check_job_fields,
    check_plan_fields,
)
from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.regions import RegionSet, TensorLayout, discover_regions
from kvtier.transfer.routes import (
    ROUTES,
    STORE_ROUTES,
    Direction,
    LaneCopiers,
    Route,
    Task,
    run_task,
)
from kvtier.transfer.worker_checks import check_worker_invariants
from kvtier.transfer.worker_config import WorkerConfig, WorkerState
from kvtier.transfer.worker_reports import WorkerReports
from kvtier.transfer.worker_resources import WorkerResources, release_dropped

__all__ = ["OffloadWorker", "WorkerConfig", "WorkerState"]

logger = logging.getLogger(__name__)


class OffloadWorker(WorkerReports):
    """Execute transfer plans on one rank; see the module docstring for routes and ordering.

    Call every method from one thread (the engine's, the one that creates the worker).
    Transfer failures (I/O error, short read/write, checksum mismatch) become
    `WorkerReport.failed` entries, with the bad disk slots in `WorkerReport.bad_blocks`
    when those were the only failures of a disk read (see `disk_mover`); contract
    violations (unknown tier, block ids that are not ints or out of range, repeated
    event ids, fields of the wrong type) raise ValueError. Call `shutdown()` (or use the
    worker as a context manager); a worker dropped without it is released by a finalizer
    (see `worker_resources`), with a warning. The report hand-off (`poll`, `peek`,
    `acknowledge`) comes from `WorkerReports`.
    """

    def __init__(self, config: WorkerConfig, file_io: FileIO | None = None) -> None:
        self.config = config
        self._file_io = file_io
        self.state = WorkerState.CREATED
        self._regions: RegionSet | None = None
        self._engine_rows: tuple[torch.Tensor, ...] = ()  # per region, in the row dtype
        self._host_rows: tuple[torch.Tensor, ...] = ()
        self._disk: DiskMover | None = None
        self._lanes = {d: TransferLane(d.value, config.copy_threads) for d in Direction}
        # Everything to release; never references the worker, so the finalizer can run.
        self._held = WorkerResources(
            config.rank, tuple(self._lanes.values()), threading.current_thread()
        )
        self._finalizer = weakref.finalize(self, release_dropped, self._held)
        self._copiers: dict[Direction, LaneCopiers] = {}
        self._in_flight: set[int] = set()
        self._compute_marker: torch.cuda.Event | None = None

    # ---------------------------------------------------------------- registration

    def register(
        self,
        kv_tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        layout: TensorLayout = TensorLayout.AUTO,
    ) -> None:
        """Discover the engine's KV regions and allocate the tiers (once).

        Raises ValueError for KV layouts that cannot be addressed by block id, and the
        disk tier's errors (existing file, lock held by another worker (DiskTierBusyError),
        unaligned slots for direct I/O, no O_DIRECT).
        """
        if self.state is not WorkerState.CREATED:
            raise RuntimeError(f"register() on a worker that is {self.state.value}")
        regions = discover_regions(kv_tensors, layout)
        on_cuda = regions.device.type == "cuda"
        try:
            self._allocate_tiers(regions, on_cuda)
            copiers = {}
            for direction in Direction:  # CUDA streams: may fail (out of memory) too
                host = CpuCopier(self._lanes[direction].crew)
                engine = CudaCopier(regions.device) if on_cuda else host
                copiers[direction] = LaneCopiers(engine=engine, host=host)
        except BaseException:
            self._drop_tier_views()
            self._held.release_tiers()
            raise
        self._regions = regions
        self._copiers.update(copiers)
        self.state = WorkerState.REGISTERED
        logger.info(
            "offload worker rank %d: %d regions, %d blocks, %d B per slot",
            self.config.rank,
            len(regions.regions),
            regions.num_blocks,
            regions.bytes_per_slot,
        )

    def _allocate_tiers(self, regions: RegionSet, on_cuda: bool) -> None:
        cfg = self.config
        disk: DiskTier | None = None
        if cfg.cpu_num_slots:
            sizes = [r.bytes_per_block for r in regions.regions]
            self._held.host = HostTier(sizes, cfg.cpu_num_slots, pin=on_cuda)
        if cfg.disk_num_slots:
            disk_config = DiskTierConfig(
                path=cfg.disk_file(),
                num_slots=cfg.disk_num_slots,
                bytes_per_slot=regions.bytes_per_slot,
                io_mode=cfg.disk_io_mode,
                num_buffers=cfg.disk_buffer_slots,
                batch_bytes=cfg.disk_batch_bytes,
                fingerprint=cfg.disk_fingerprint if cfg.disk_persist else None,
                region_layout=";".join(f"{r.name}:{r.bytes_per_block}" for r in regions.regions),
            )
            disk = self._held.disk_tier = DiskTier(disk_config, self._file_io)
            if on_cuda:
                for buffer in (*disk.store_buffers, *disk.load_buffers):
                    pin_host_memory(buffer.tensor)
                    self._held.pinned_staging.append(buffer.tensor)
        self._view_rows(regions, disk)

    def _view_rows(self, regions: RegionSet, disk: DiskTier | None) -> None:
        """View every byte region as rows of one dtype (int64 when all allow it)."""
        engine = regions.block_views()
        host = self._held.host.views if self._held.host else ()
        columns = regions.slot_columns()
        staging = [b.tensor for b in (*disk.store_buffers, *disk.load_buffers)] if disk else []
        cuts = [t[:, a:b] for t in staging for a, b in columns]
        dtype = row_dtype(*engine, *host, *staging, *cuts)
        self._engine_rows = tuple(v.view(dtype) for v in engine)
        self._host_rows = tuple(v.view(dtype) for v in host)
        if disk is not None:
            size = dtype.itemsize
            spans = [(a // size, b // size) for a, b in columns]
            self._disk = DiskMover(disk, spans, dtype)

    @property
    def num_blocks(self) -> int:
        """Return the number of engine blocks per region."""
        return self._require_regions().num_blocks

    @property
    def bytes_per_slot(self) -> int:
        """Return the bytes of one block id over all regions (one lower-tier slot)."""
        return self._require_regions().bytes_per_slot

    @property
    def regions(self) -> RegionSet:
        """Return the registered regions."""
        return self._require_regions()

    @property
    def host_tier(self) -> HostTier | None:
        """Return the host tier, or None without one or after shutdown (read-only use:
        tests, metrics)."""
        return self._held.host

    @property
    def disk_path(self) -> str | None:
        """Return the slot file's path, or None without a disk tier or after shutdown."""
        return self._disk.disk.path if self._disk else None

    def recovered_slots(self) -> list[tuple[int, SlotRecord]]:
        """Return the `(slot id, record)` pairs a persistent disk tier recovered from the
        previous run, by slot id (after `register()`; empty without any)."""
        self._require_regions()
        disk = self._held.disk_tier
        if disk is None:
            return []
        return [(slot, rec) for slot, rec in disk.recovered_slots() if slot != 0]

    def _require_regions(self) -> RegionSet:
        if self._regions is None:
            raise RuntimeError("the worker has no KV tensors yet; call register() first")
        return self._regions

    # ---------------------------------------------------------------- transfers

    def record_compute_done(self) -> None:
        """Mark the end of the forward pass just launched on the current CUDA stream.

        Optional: `submit()` records the marker itself when this was not called since the
        previous submit (one that failed included: it used the marker up). Call it when
        `submit()` runs later or on another stream. No-op on the CPU.
        """
        regions = self._require_regions()
        if regions.device.type == "cuda":
            self._compute_marker = record_compute_marker(regions.device)

    def submit(self, plan: TransferPlan) -> None:
        """Start every job of `plan` in the background and return at once.

        Ends a persistent disk tier's persistence first when `plan.end_persistence` (a
        reset: see `DiskTier.end_persistence`), drops the manifest records of
        `plan.forget_slots` (see `DiskTier.forget`), then flushes when `plan.need_flush` (a
        preempted request's blocks may be reused). Validates the whole plan's jobs before
        starting any.
        """
        if self.state is not WorkerState.REGISTERED:
            raise RuntimeError(f"submit() on a worker that is {self.state.value}")
        # This submit's, even if it fails below: a later one must not wait on a stale marker.
        recorded, self._compute_marker = self._compute_marker, None
        check_plan_fields(plan)
        if plan.end_persistence:
            self.end_persistence()
        if plan.forget_slots:
            self.forget_slots(plan.forget_slots)
        if plan.need_flush:
            self.flush()
        # In flight, or reported and not acknowledged: the lane holds its report still.
        seen = {e for lane in self._lanes.values() for e in lane.pending_event_ids()}
        prepared = []
        for job in plan.jobs:
            checked = self._validate(job)
            if job.event_id in seen:
                raise ValueError(
                    f"event {job.event_id} is already in flight (or its report is not acknowledged)"
                )
            seen.add(job.event_id)
            prepared.append((job, *checked))
        needed = any(job.src_tier is Tier.GPU for job in plan.jobs)
        marker = self._compute_marker_for(needed, recorded)
        for job, route, src_ids, dst_ids in prepared:
            records = job.dst_records if job.dst_tier is Tier.DISK and job.dst_records else None
            job_marker = marker if job.src_tier is Tier.GPU else None
            task = Task(route, src_ids, dst_ids, job_marker, records)
            direction = Direction.STORE if route in STORE_ROUTES else Direction.LOAD
            run = functools.partial(
                run_task,
                task,
                self._copiers[direction],
                self._engine_rows,
                self._host_rows,
                self._disk,
            )
            lane = self._lanes[direction]
            try:  # recorded inside: an interrupt right after it is undone below
                self._in_flight.add(job.event_id)
                lane.submit(job.event_id, run)
            except BaseException:  # an interrupt: the lane may have taken the job or not
                if job.event_id not in lane.pending_event_ids():
                    self._in_flight.discard(job.event_id)
                raise

    def _compute_marker_for(
        self, needed: bool, recorded: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        if needed and recorded is None and self._require_regions().device.type == "cuda":
            return record_compute_marker(self._require_regions().device)
        return recorded

    def _validate(self, job: TransferJob) -> tuple[Route, np.ndarray, np.ndarray]:
        check_job_fields(job)
        event_id, src, dst = job.event_id, job.src_tier, job.dst_tier
        route = ROUTES.get((src, dst))
        if route is None:
            raise ValueError(f"event {event_id}: no route {src.value} → {dst.value}")
        src_size, dst_size = self._tier_size(src, event_id), self._tier_size(dst, event_id)
        src_ids = block_id_array(event_id, f"{src.value} ids", job.src_block_ids, src_size)
        dst_ids = block_id_array(event_id, f"{dst.value} ids", job.dst_block_ids, dst_size)
        check_distinct(event_id, "destination ids", dst_ids)
        # TransferJob.__post_init__ checks the counts too, but a pickled job skipped it.
        check_counts(event_id, len(src_ids), len(dst_ids), job.dst_records)
        if dst is Tier.DISK and self._held.disk_tier is not None:
            self._held.disk_tier.check_records(job.dst_records, f"event {event_id}: ")
        return route, src_ids, dst_ids

    def _tier_size(self, tier: Tier, event_id: int) -> int:
        if tier is Tier.GPU:
            return self.num_blocks
        size = self.config.cpu_num_slots if tier is Tier.CPU else self.config.disk_num_slots
        if not size:
            raise ValueError(f"event {event_id}: this worker has no {tier.value} tier")
        return size

    def flush(self) -> None:
        """Block until every submitted transfer finished (done or failed)."""
        for lane in self._lanes.values():
            lane.wait_all()

    # ---------------------------------------------------------------- lifecycle

    def end_persistence(self) -> None:
        """End a persistent disk tier's persistence now (idempotent; see
        `DiskTier.end_persistence`): for a reset that no later plan carried. RuntimeError
        unless registered: before register() the tier is not open (register would restore
        the records), once shutdown() began it is released (the records would stay)."""
        self._require_registered("end_persistence()")
        if self._held.disk_tier is not None:
            self._held.disk_tier.end_persistence()

    def forget_slots(self, slots: Sequence[int]) -> None:
        """`DiskTier.forget` now: for dropped copies that no later plan carried.
        RuntimeError unless registered, as `end_persistence`: a restart would restore
        them."""
        self._require_registered("forget_slots()")
        if self._held.disk_tier is not None:
            self._held.disk_tier.forget(slots)

    def _require_registered(self, call: str) -> None:
        if self.state is not WorkerState.REGISTERED:
            raise RuntimeError(f"{call} on a worker that is {self.state.value}")

    def shutdown(self) -> None:
        """Finish outstanding transfers, stop the threads, free the tiers, remove the disk
        file (a persistent one is synced and kept, with its manifest); idempotent.

        The worker is SHUTTING_DOWN (refusing new work) until the release completes: a
        shutdown interrupted while waiting for a transfer (KeyboardInterrupt), or one where
        a tier's close raised (the other tiers are released all the same; the first error
        is re-raised), is finished by calling shutdown() again. Finished events can still
        be polled afterwards.
        """
        if self.state is WorkerState.SHUT_DOWN:
            return
        self.state = WorkerState.SHUTTING_DOWN
        self._drop_tier_views()
        self._held.release()
        self._finalizer.detach()
        self.state = WorkerState.SHUT_DOWN

    def _drop_tier_views(self) -> None:
        """Forget the worker's own views of the tiers (the lanes' queued jobs keep theirs)."""
        self._disk = None
        self._engine_rows = self._host_rows = ()

    def __enter__(self) -> OffloadWorker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def check_invariants(self) -> None:
        """Raise AssertionError if the worker's bookkeeping or tiers are inconsistent."""
        check_worker_invariants(self)
