"""The reference engine's wiring of kvtier: offload scheduler + worker, step by step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.core.block_pool import BlockPool
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.core.plural import counted
from kvtier.engine.config import AttentionKind
from kvtier.engine.request import Request
from kvtier.engine.runner import ModelRunner
from kvtier.engine.scheduler import SchedulerStep
from kvtier.engine.sigint_deferral import SigintDeferral
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier, TransferPlan, WorkerReport
from kvtier.offload.protocols import ScheduledRequest, StepInput
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from kvtier.offload.stats import OffloadStats
from kvtier.offload.transfers import FailedLoad, ReportOutcome
from kvtier.transfer.regions import TensorLayout
from kvtier.transfer.worker import OffloadWorker, WorkerConfig, WorkerState


def layout_of(runner: ModelRunner) -> KVLayout:
    """Return kvtier's view of the runner's KV groups."""
    groups = []
    for group in runner.layer_groups:
        kind = (
            GroupKind.SLIDING_WINDOW
            if group.kind is AttentionKind.SLIDING
            else GroupKind.FULL_ATTENTION
        )
        groups.append(
            KVGroupSpec(
                kind,
                runner.block_size,
                runner.bytes_per_block(group.group_id),
                group.sliding_window,
            )
        )
    return KVLayout(tuple(groups))


@dataclass(slots=True)
class OffloadTotals:
    """Cumulative transfer counters of one engine."""

    num_bytes_loaded: int = 0
    num_bytes_stored: int = 0
    num_failed_loads: int = 0
    num_failed_stores: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    num_demoted_blocks: int = 0
    num_promoted_blocks: int = 0
    num_failed_demotions: int = 0
    num_dropped_demotions: int = 0  # no disk slot was free (cascade)
    num_lost_blocks: int = 0  # CPU evictions with no disk copy (write-back bursts, failures)
    num_tag_mismatches: int = 0  # tier blocks the token check refused (hash collisions)
    # Per direction (`GPU_to_CPU`, ...): bytes and copy seconds of completed transfers.
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    transfer_seconds: dict[str, float] = field(default_factory=dict)
    num_issued_events: int = 0  # transfer events planned (jobs)
    num_reported_events: int = 0  # events reported done or failed


class OffloadSide:
    """Drive one `OffloadScheduler` and one `OffloadWorker` from the engine's step loop.

    `fingerprint` names what the KV bytes depend on (model, weights, layout, hashing);
    a persistent disk tier is reused only by an engine with the same one.
    """

    def __init__(
        self, config: OffloadConfig, runner: ModelRunner, pool: BlockPool, fingerprint: str = ""
    ) -> None:
        layout = layout_of(runner)
        sizes = {
            tier: config.num_tier_blocks(layout.bytes_per_block, tier) for tier in config.tiers
        }
        setup = SchedulerSetup(
            layout,
            sizes[config.tier],
            num_workers=1,
            gpu_pool=pool,
            num_disk_blocks=sizes.get(Tier.DISK, 0) if config.is_cascade else 0,
        )
        self.scheduler = OffloadScheduler(config, setup)
        self.worker = OffloadWorker(_worker_config(config, sizes, fingerprint))
        self.worker.register(runner.kv_tensors, TensorLayout.KV_FIRST)  # [2, blocks, ...]
        self.num_restored_blocks = 0
        if config.disk_persist:
            recovered = self.worker.recovered_slots()
            self.num_restored_blocks = self.scheduler.restore(Tier.DISK, recovered)
        self.totals = OffloadTotals()
        self._plan: TransferPlan | None = None
        self._finished_ids: frozenset[str] = frozenset()
        self._owes_flush = False  # a flush failed: retry it before the next plan
        # Events of a plan being handed to the worker, or refused by it and not yet sorted:
        # the worker may have started some of them. While any is left, the next plan is
        # flushed for first; once a flush succeeds, those still unreported never started.
        self._unconfirmed: set[int] = set()
        # Reports made up for plans the worker never took, applied by the next `poll`.
        self._held_reports: list[WorkerReport] = []
        # Outcomes of applied reports the engine has not applied yet (`outcome_applied`).
        self._outcomes: list[ReportOutcome] = []

    def prepare(self, step: SchedulerStep) -> None:
        """Build this step's plan; flush the worker first if a request was preempted (or
        events are unconfirmed, see `submit`).

        A plan never submitted (its flush failed, or an interrupt came in between) is
        failed, as the worker never saw it, by the next `prepare`; a failed flush is
        retried then, before that step's plan. A Ctrl-C while the plan is built is held
        until the plan is recorded (`SigintDeferral`, main thread only), its
        KeyboardInterrupt raised then.
        """
        if self._plan is not None:
            self._fail_unsubmitted(self._plan, WorkerReport())
            self._plan = None
        scheduled = tuple(
            ScheduledRequest(w.request, w.new_block_ids, w.num_new_tokens, w.table_update)
            for w in step.work
        )
        step_input = StepInput(
            scheduled=scheduled,
            finished_request_ids=self._finished_ids,
            preempted_request_ids=frozenset(step.preempted_ids),
        )
        # A Ctrl-C cutting the build short would strand what it took or issued (tier
        # slots, events no worker sees): held until the plan is recorded, it interrupts
        # before the flush, where the next `prepare` fails the unsubmitted plan.
        with SigintDeferral():
            plan = self._plan = self.scheduler.build_plan(step_input)
            self._finished_ids = frozenset()
            self.totals.num_issued_events += len(plan.jobs)
            self._owes_flush = self._owes_flush or plan.need_flush
        if self._owes_flush or self._unconfirmed:
            self.worker.flush()
            # Cleared only afterwards: an interrupt in between retries the whole of it.
            self._fail_unconfirmed()
            self._owes_flush = False

    def submit(self) -> None:
        """Hand this step's plan to the worker; its copies run beside the forward pass.

        If the worker refuses the plan (or is interrupted), every event of it the worker
        did not take is reported failed at the next `poll` (SPEC §6.8: loads recompute,
        stores register nothing) and the error propagates. Jobs the worker started are
        waited for first, so no event is failed while its copy still runs; if that flush
        fails too, or an interrupt cuts any of this short, the flush before the next
        plan sorts the events (their pins held until then).
        """
        plan = self._plan
        if plan is None or not (plan.jobs or plan.end_persistence or plan.forget_slots):
            self._plan = None
            return
        event_ids = [job.event_id for job in plan.jobs]
        # Unconfirmed from before the worker sees them until it took them all: wherever an
        # interrupt lands, the events are the unsubmitted plan (failed by the next
        # `prepare`) or unconfirmed (sorted by its flush), or both for a moment (held
        # failed twice, which is harmless: see `_fail_unconfirmed`).
        self._unconfirmed.update(event_ids)
        self._plan = None
        try:
            self.worker.submit(plan)
        except BaseException:
            self._requeue_forget(plan)
            self.worker.flush()  # what it started ends first: none fails while it copies
            self._fail_unconfirmed()
            raise
        self._unconfirmed.difference_update(event_ids)

    def _requeue_forget(self, plan: TransferPlan) -> None:
        """Give a later plan the slots `plan` was to drop, the worker may not have seen them.

        Not those `plan` also writes: the worker drops a plan's records before starting
        any of its jobs, so a job of it that ran and succeeded wrote its records after
        the drop, and they stand; one that failed or never ran is reported failed, and
        its failure drops the slots again (`DroppedSlots`)."""
        written = {
            slot for job in plan.jobs if job.dst_tier is Tier.DISK for slot in job.dst_block_ids
        }
        self.scheduler.dropped_slots.add(s for s in plan.forget_slots if s not in written)

    def _fail_unconfirmed(self) -> None:
        """After a successful flush: fail the unconfirmed events the worker never started
        (a flushed worker reports, at its next poll, all it started).

        The worker keeps what it reported until `poll` applied it (`acknowledge`), so
        only the failures are held here. The debt is cleared only once they are held, so
        an interrupt at worst holds some twice, which `TransferBook.complete` takes as
        failed or ignores, never as done."""
        if not self._unconfirmed:
            return
        self._hold_failures(self.worker.peek(), self._unconfirmed)
        self._unconfirmed.clear()

    def _fail_unsubmitted(self, plan: TransferPlan, started: WorkerReport) -> None:
        """Hold a failure of each event of `plan` that `started` lacks, for `poll`."""
        self.scheduler.dropped_slots.add(plan.forget_slots)  # the next plan drops them
        self._hold_failures(started, [job.event_id for job in plan.jobs])

    def _hold_failures(self, started: WorkerReport, event_ids: Iterable[int]) -> None:
        """Hold a failure of each of `event_ids` that `started` lacks, for `poll`."""
        reported = {*started.done, *started.failed}
        # One count per event: this engine runs one worker.
        failed = {event_id: 1 for event_id in event_ids if event_id not in reported}
        self._held_reports.append(WorkerReport(failed=failed))

    def finish_step(self, finished: Sequence[Request]) -> None:
        """Remember which requests finished, for the next plan's hand-off filtering; a
        repeat (a call cut short) adds to what the next plan is told."""
        self._finished_ids = self._finished_ids | {r.request_id for r in finished}

    def poll(self) -> ReportOutcome:
        """Apply whatever the worker finished; return loads finished or failed, with
        those of earlier polls not yet applied (`outcome_applied`).

        The worker keeps its reports (`OffloadWorker.peek`), and this side its held
        failures and the outcomes, until they are applied: an interrupt on the way leaves
        them all to the next poll, which applies each event once (`TransferCompletion.apply`
        finishes an apply cut short; events applied already are ignored:
        `TransferBook.complete`), or to the engine (`unapplied_outcome`).

        Disk copies the report made the scheduler drop lose their manifest records at
        once (`_forget_dropped`), not with the next plan: an engine left idle, then
        killed, would leave them for a restart to restore.
        """
        report = WorkerReport.merge([*self._held_reports, self.worker.peek()])
        if self._unconfirmed:
            self._unconfirmed.difference_update(report.done, report.failed)
        self._outcomes.append(self.scheduler.apply_report(report))
        self.worker.acknowledge()
        self._held_reports = []
        self.totals.num_reported_events += _num_events(report)
        self._account(self.scheduler.take_stats())
        self._forget_dropped()  # raising, it leaves the outcome to the engine
        return self.unapplied_outcome()

    def has_unapplied_outcome(self) -> bool:
        """Return True when loads finished or failed that the engine has not applied."""
        return any(o.finished_loads or o.failed_loads for o in self._outcomes)

    def unapplied_outcome(self) -> ReportOutcome:
        """Return the loads finished or failed, in order, since `outcome_applied`.

        Kept until the engine confirms it applied them: one lost on the way (a Ctrl-C
        before or while the engine applied it) would leave its request waiting for good.
        """
        if len(self._outcomes) > 1:
            self._outcomes[:] = [_joined(self._outcomes)]  # one statement: none lost
        return self._outcomes[0] if self._outcomes else ReportOutcome()

    def outcome_applied(self) -> None:
        """Forget the outcome `unapplied_outcome` returned: the engine applied it all."""
        self._outcomes.clear()

    def _forget_dropped(self) -> None:
        """Hand the worker the dropped disk slots no plan carried yet (`DiskTier.forget`).

        No write of them is in flight: the scheduler drops a slot only once every job
        writing it reported, and reuses it only in a later plan, whose jobs run after
        this. What the worker refuses goes with the next plan (or the shutdown)."""
        dropped = self.scheduler.dropped_slots
        if not dropped or self.worker.state is not WorkerState.REGISTERED:
            return
        slots = dropped.take()
        try:
            self.worker.forget_slots(slots)
        except BaseException:
            dropped.add(slots)
            raise

    def _account(self, stats: OffloadStats) -> None:
        totals = self.totals
        totals.num_bytes_loaded += stats.num_bytes_loaded
        totals.num_bytes_stored += stats.num_bytes_stored
        totals.num_failed_loads += stats.num_failed_loads
        totals.num_failed_stores += stats.num_failed_stores
        totals.hit_tokens = dict(stats.hit_tokens)
        totals.num_demoted_blocks += stats.num_demoted_blocks
        totals.num_promoted_blocks += stats.num_promoted_blocks
        totals.num_failed_demotions += stats.num_failed_demotions
        totals.num_dropped_demotions += stats.num_dropped_demotions
        totals.num_lost_blocks += stats.num_lost_blocks
        totals.num_tag_mismatches += stats.num_tag_mismatches
        for kind, num_bytes in stats.transfer_bytes.items():
            totals.transfer_bytes[kind] = totals.transfer_bytes.get(kind, 0) + num_bytes
        for kind, seconds in stats.transfer_seconds.items():
            totals.transfer_seconds[kind] = totals.transfer_seconds.get(kind, 0.0) + seconds

    def has_pending_work(self) -> bool:
        """Return True while finish-time stores are queued or in flight."""
        return self.scheduler.has_pending_stores()

    def describe_pending(self) -> str:
        """Return what keeps `has_pending_work()` true, for error messages."""
        scheduler = self.scheduler
        _, num_pending_blocks, _ = scheduler.stats_gauges()
        blocks = counted(num_pending_blocks, "block")
        text = f"{blocks} queued or in flight to the {scheduler.tier.value} tier"
        if scheduler.cascade is not None:
            demotions = counted(len(scheduler.cascade.in_flight_keys), "demotion")
            text += f", {demotions} queued or in flight"
        num_events, num_abandoned = scheduler.store_events_in_flight()
        if num_events:  # a reset lets go of its abandoned transfers' blocks and keys
            text += (
                f"; {counted(num_events, 'store or demotion event')} issued and never reported"
                f" ({num_abandoned} of them abandoned by a reset)"
            )
        return text

    def reset(self) -> bool:
        """Drop every block of the lower tiers (`OffloadScheduler.reset`); True once no
        transfer is outstanding. A persistent disk tier's manifest is emptied (fsynced)
        before this returns: a crash right after restores nothing from before."""
        done = self.scheduler.reset()
        if self.scheduler.persistence_ended and self.worker.state is WorkerState.REGISTERED:
            self.worker.end_persistence()
        return done

    def flush(self) -> None:
        """Block until every transfer handed to the worker finished (done or failed)."""
        self.worker.flush()

    def shutdown(self) -> None:
        """Stop the worker (idempotent); a reset's end of persistence, or dropped disk
        copies' manifest records, that no submitted plan carried yet (a plan prepared and
        never submitted included) reach the worker first. The worker stops even when that
        hand-over raises (OSError: the manifest can be neither appended to, nor emptied
        or removed)."""
        scheduler = self.scheduler
        if self._plan is not None:  # prepared, never submitted (an interrupt in between)
            scheduler.dropped_slots.add(self._plan.forget_slots)
            self._plan = None
        owed = scheduler.persistence_ended or bool(scheduler.dropped_slots)
        try:
            if owed and self.worker.state is WorkerState.REGISTERED:
                if scheduler.persistence_ended:
                    self.worker.end_persistence()
                else:  # disk copies dropped since the last plan: a restart must not find them
                    self.worker.forget_slots(scheduler.dropped_slots.take())
        finally:
            self.worker.shutdown()


def _worker_config(config: OffloadConfig, sizes: dict[Tier, int], fingerprint: str) -> WorkerConfig:
    if Tier.DISK not in sizes:
        return WorkerConfig(cpu_num_slots=sizes[Tier.CPU], copy_threads=1)
    return WorkerConfig(
        cpu_num_slots=sizes.get(Tier.CPU, 0),
        disk_num_slots=sizes[Tier.DISK],
        disk_path=config.disk_path,
        disk_io_mode=config.disk_io_mode,
        disk_buffer_slots=config.disk_buffer_slots,
        copy_threads=1,
        disk_persist=config.disk_persist,
        disk_fingerprint=fingerprint if config.disk_persist else "",
    )


def _num_events(report: WorkerReport) -> int:
    """Return how many events `report` names (one both done and failed counts once)."""
    num_events = len(report.done) + len(report.failed)
    if report.done and report.failed:
        num_events -= len(report.done.keys() & report.failed.keys())
    return num_events


def _joined(outcomes: Iterable[ReportOutcome]) -> ReportOutcome:
    """Return one outcome with the finished and failed loads of `outcomes` (in order)
    and their suspect GPU blocks."""
    finished: list[str] = []
    failed: list[FailedLoad] = []
    suspects: dict[str, tuple[int, ...]] = {}
    for outcome in outcomes:
        finished += outcome.finished_loads
        failed += outcome.failed_loads
        suspects.update(outcome.suspect_gpu_blocks)
    return ReportOutcome(tuple(finished), tuple(failed), suspects)
