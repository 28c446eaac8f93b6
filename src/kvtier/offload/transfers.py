"""Bookkeeping of issued transfers: completion counting across workers, abandonment."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from kvtier.offload.cascade import MoveItem
from kvtier.offload.plan import Tier, TransferJob, WorkerReport
from kvtier.offload.report_checks import check_load_parts, check_report_counts
from kvtier.offload.store_batch import StoreBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailedLoad:
    """A load that will not happen: the engine must recompute tokens [start, end).

    `whole`: no block of it is known to be whole (a failure named no bad blocks, or it
    was never issued); False when the workers named every bad block of its failed events,
    so only those blocks' copies are suspect (`ReportOutcome.suspect_gpu_blocks`). Not
    part of its identity.
    """

    request_id: str
    start_token: int
    end_token: int
    whole: bool = field(default=True, compare=False)


@dataclass(frozen=True)
class ReportOutcome:
    """What the engine must act on after `apply_report`.

    `suspect_gpu_blocks[request_id]`, for a failed load of issued events, lists the GPU
    blocks (of any group) whose copy cannot be trusted: every other GPU block of that
    load was written whole. Absent for a load dropped before it was issued.
    """

    finished_loads: tuple[str, ...] = ()
    failed_loads: tuple[FailedLoad, ...] = ()
    suspect_gpu_blocks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class LoadProgress:
    """One request's load over one or more tiers: parts still to finish, any failure.

    `tier_tokens`: the accepted tokens each tier serves (tier value -> tokens), counted as
    hit tokens once every part finished and none failed. `request_gone`: the request
    finished while the load was in flight, so its outcome is no one's (`drop_outcomes`).
    """

    request_id: str
    start_token: int
    end_token: int
    num_pending: int
    failed: bool = False
    tier_tokens: dict[str, int] = field(default_factory=dict)
    suspect_gpu_blocks: list[int] = field(default_factory=list)  # of its failed parts
    failed_whole: bool = False  # a failed part of it named no bad blocks
    request_gone: bool = False

    def failure(self) -> FailedLoad:
        """Return the failed load of the whole range (conservative across tiers)."""
        whole = self.failed_whole or not self.suspect_gpu_blocks
        return FailedLoad(self.request_id, self.start_token, self.end_token, whole)


@dataclass(slots=True)
class LoadItem:
    """The part of a request's load that one tier serves: its blocks into GPU blocks."""

    tier: Tier
    tier_block_ids: list[int]
    gpu_block_ids: list[int]
    progress: LoadProgress

    @property
    def request_id(self) -> str:
        """Return the id of the request this part loads for."""
        return self.progress.request_id


@dataclass(slots=True)
class IssuedTransfer:
    """One issued event and what it carries, with its worker counts."""

    job: TransferJob
    loads: list[LoadItem] = field(default_factory=list)
    stores: StoreBatch = field(default_factory=StoreBatch)
    moves: list[MoveItem] = field(default_factory=list)
    num_done: int = 0
    num_failed: int = 0
    abandoned: bool = False
    seconds: float = 0.0  # the slowest worker's copy time so far
    # Completion steps applied (`TransferCompletion`): one applied is never redone.
    num_applied: int = 0
    # Taken off the book's aggregates (`TransferBook._forget`), still in `_issued`.
    forgotten: bool = False
    # The source blocks failing workers found bad, while every failure named its own
    # (`WorkerReport.bad_blocks`); None once one did not: every block is suspect.
    bad_blocks: set[int] | None = field(default_factory=set)

    @property
    def transfer_type(self) -> str:
        """Return the direction as vLLM labels it, e.g. `GPU_to_CPU`."""
        return f"{self.job.src_tier.value}_to_{self.job.dst_tier.value}"

    @property
    def succeeded(self) -> bool:
        """Return True when no worker failed the event."""
        return self.num_failed == 0

    def num_copied_blocks(self) -> int:
        """Return how many of the job's blocks every worker copied whole: all when it
        succeeded; for a failed load whose workers named its bad blocks, every source
        block but those; else (nothing is known to be whole) none."""
        if self.succeeded:
            return self.job.num_blocks
        if not self.bad_blocks or not self.job.is_load:
            return 0
        bad = self.bad_blocks
        return sum(1 for b in self.job.src_block_ids if b not in bad)

    def suspect(self, block_ids: list[int]) -> list[int]:
        """Return those of the event's source `block_ids` whose copy cannot be trusted:
        none when it succeeded, the bad ones when the workers named them, else all."""
        if self.succeeded:
            return []
        if not self.bad_blocks:  # None, or no failure named any (fail closed)
            return block_ids
        return [b for b in block_ids if b in self.bad_blocks]

    def note_failure(self, bad_blocks: frozenset[int] | None) -> None:
        """Take one report's failure of the event, with the bad source blocks it named."""
        if self.bad_blocks is None:
            return
        if bad_blocks is not None and bad_blocks and bad_blocks <= set(self.job.src_block_ids):
            self.bad_blocks.update(bad_blocks)
            return
        if bad_blocks is not None:
            logger.warning(
                "event %d: bad blocks %s are none or not all source blocks of it; every "
                "block is suspect",
                self.job.event_id,
                sorted(bad_blocks),
            )
        self.bad_blocks = None


class TransferBook:
    """Issued transfers by event id; an event completes once every worker reported it."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._issued: dict[int, IssuedTransfer] = {}
        # Issued events complete (every worker reported them) whose effects are not all
        # applied yet: `complete` returns them until `forget` (see there).
        self._completed: dict[int, IssuedTransfer] = {}
        self._last_event_id = 0
        self._unissued_failures: list[FailedLoad] = []
        # Kept as transfers are issued and completed, so a step never scans `_issued`.
        self._load_request_ids: dict[int, tuple[str, ...]] = {}
        self._num_store_events = 0  # issued events carrying stores or demotions
        self.num_store_blocks = 0  # store items and demotions of issued events

    def next_event_id(self) -> int:
        """Return a new event id; ids never repeat, not even after a reset."""
        self._last_event_id += 1
        return self._last_event_id

    def issue(self, transfer: IssuedTransfer) -> None:
        """Record an issued event; raise ValueError when a load's `load_parts` are not
        its loads' block counts in order (workers would fail the wrong requests)."""
        event_id = transfer.job.event_id
        if transfer.loads or transfer.job.load_parts:
            check_load_parts(transfer.job, transfer.loads)
        self._issued[event_id] = transfer
        if transfer.loads:
            self._load_request_ids[event_id] = tuple(item.request_id for item in transfer.loads)
        if transfer.stores or transfer.moves:
            self._num_store_events += 1
            self.num_store_blocks += len(transfer.stores) + len(transfer.moves)

    def drop_outcomes(self, request_id: str) -> bool:
        """Mark the issued loads of finished request `request_id` as gone; return True
        when it has one.

        Their pins stay until the workers report them (SPEC §6.7), but their outcome is
        returned to no one: a request admitted since under the same id (an engine whose
        ids repeat) would take the earlier load's completion for its own load's, and
        compute while its own load still copies (or be rewound by the earlier failure).
        """
        gone = False
        for transfer in self._issued.values():
            for load in transfer.loads:
                if load.request_id == request_id:
                    load.progress.request_gone = gone = True
        return gone

    def fail_unissued(self, failure: FailedLoad) -> None:
        """Queue a load failure that never reached a worker, for the next report."""
        self._unissued_failures.append(failure)

    def drop_unissued_failures(self, request_id: str) -> bool:
        """Forget the queued failures of finished request `request_id`; return True when
        it had one. As for `drop_outcomes`: a request admitted since under its id must
        not take them; the caller tells the engine instead (`on_finished` returns True)."""
        failures = self._unissued_failures
        kept = [failure for failure in failures if failure.request_id != request_id]
        self._unissued_failures = kept
        return len(kept) != len(failures)

    def has_unissued_failures(self) -> bool:
        """Return True while failures queued by `fail_unissued` await `take_unissued_failures`."""
        return bool(self._unissued_failures)

    def take_unissued_failures(self) -> list[FailedLoad]:
        """Return and forget the queued failures."""
        failures, self._unissued_failures = self._unissued_failures, []
        return failures

    def complete(self, report: WorkerReport) -> list[IssuedTransfer]:
        """Add a report's worker counts; return the events that are complete: those
        completed by an earlier call and not yet forgotten (an apply an interrupt cut
        short), then those this report completes. A complete event stays in flight, and
        is not counted again, until the caller applied it and called `forget`.

        A count that is not an int >= 0 refuses the whole report (ValueError, nothing
        applied). Event ids not in flight (reported before, or never issued) are ignored
        with a warning. An event reported by more workers than there are was reported
        twice by some worker: it completes as failed, since which workers really copied
        it is unknown (a failed store registers nothing, a failed load is recomputed).
        """
        check_report_counts(report)
        touched: list[IssuedTransfer] = []
        unknown: list[int] = []
        completed = self._completed
        for counts, failed in ((report.done, False), (report.failed, True)):
            for event_id, count in counts.items():
                transfer = self._issued.get(event_id)
                if transfer is None:
                    unknown.append(event_id)
                    continue
                if event_id in completed:
                    continue  # counted by a call whose apply an interrupt cut short
                if failed:
                    transfer.num_failed += count
                    if count:
                        named = report.bad_blocks.get(event_id)
                        transfer.note_failure(named)
                        if named is not None:  # the other blocks were copied: timed
                            seconds = _copy_seconds(report, event_id)
                            transfer.seconds = max(transfer.seconds, seconds)
                else:
                    transfer.num_done += count
                    seconds = _copy_seconds(report, event_id)
                    transfer.seconds = max(transfer.seconds, seconds)
                touched.append(transfer)
        for transfer in touched:
            event_id = transfer.job.event_id
            num_reported = transfer.num_done + transfer.num_failed
            if event_id not in completed and num_reported >= self.num_workers:
                if num_reported > self.num_workers:
                    logger.warning(
                        "event %d reported by %d workers of %d: taken as failed",
                        event_id,
                        num_reported,
                        self.num_workers,
                    )
                    transfer.num_failed = max(transfer.num_failed, 1)
                    transfer.bad_blocks = None
                completed[event_id] = transfer
        if unknown:  # after the counts are settled: an interrupt here re-counts none
            logger.warning("worker report names events not in flight, ignored: %s", unknown)
        return list(completed.values()) if completed else []

    def forget(self, transfer: IssuedTransfer) -> None:
        """Drop a complete event whose effects the caller applied (see `complete`)."""
        event_id = transfer.job.event_id
        if event_id in self._issued:
            self._forget(event_id)
        self._completed.pop(event_id, None)  # last: until then `complete` returns it

    def _forget(self, event_id: int) -> None:
        """Drop an event and its share of the aggregates; safe to cut short and redo:
        the share is taken off once (`IssuedTransfer.forgotten`, set in the same
        statement), and the event leaves `_issued` last (until then `forget` redoes)."""
        transfer = self._issued[event_id]
        if not transfer.forgotten:
            has_stores = transfer.stores or transfer.moves
            num_events = self._num_store_events - 1 if has_stores else self._num_store_events
            num_blocks = self.num_store_blocks - len(transfer.stores) - len(transfer.moves)
            transfer.forgotten, self._num_store_events, self.num_store_blocks = (
                True,
                num_events,
                num_blocks,
            )
        self._load_request_ids.pop(event_id, None)
        del self._issued[event_id]

    def abandon_stores(self) -> None:
        """Mark every issued store and demotion abandoned: it will never become visible."""
        for transfer in self._issued.values():
            if transfer.stores or transfer.moves:
                transfer.abandoned = True

    def pinned_gpu_blocks(self) -> Iterator[int]:
        """Yield the GPU blocks the issued transfers still pin: the stores' sources and
        the loads' destinations of every event whose pins none of its applied steps
        released (`IssuedTransfer.num_applied`)."""
        for transfer in self._issued.values():
            if transfer.num_applied == 0:
                yield from transfer.stores.gpu_block_ids
                for load in transfer.loads:
                    yield from load.gpu_block_ids

    def load_request_ids(self) -> dict[int, tuple[str, ...]]:
        """Return every outstanding load event with the request ids it serves."""
        return dict(self._load_request_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError when the running aggregates disagree with the issued events."""
        issued = self._issued
        assert all(issued.get(e) is t for e, t in self._completed.items()), "completed events"
        # A `forgotten` event is one a `_forget` cut short left in `_issued` (see there).
        loads = {
            event_id: tuple(item.request_id for item in transfer.loads)
            for event_id, transfer in issued.items()
            if transfer.loads and not transfer.forgotten
        }
        kept = {e: r for e, r in self._load_request_ids.items() if not issued[e].forgotten}
        assert kept == loads, "outstanding load events"
        with_stores = [t for t in issued.values() if (t.stores or t.moves) and not t.forgotten]
        assert self._num_store_events == len(with_stores), "store events in flight"
        num_blocks = sum(len(t.stores) + len(t.moves) for t in with_stores)
        assert self.num_store_blocks == num_blocks, "store blocks"

    def __iter__(self) -> Iterator[IssuedTransfer]:
        return iter(self._issued.values())

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._issued

    def __len__(self) -> int:
        return len(self._issued)

    def has_stores(self) -> bool:
        """Return True while any store or demotion (abandoned ones too) is in flight."""
        return self._num_store_events > 0

    def store_events(self) -> tuple[int, int]:
        """Return how many store and demotion events are in flight, and how many of them
        a reset abandoned (for messages: this walks every issued event)."""
        abandoned = sum(1 for t in self._issued.values() if (t.stores or t.moves) and t.abandoned)
        return self._num_store_events, abandoned


def _copy_seconds(report: WorkerReport, event_id: int) -> float:
    """Return the copy time a report gives an event; 0 (with a warning) for one that is
    not a finite number of seconds >= 0 (a statistic: the counts still apply)."""
    seconds = report.seconds.get(event_id, 0.0)
    number = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    if number and math.isfinite(seconds) and seconds >= 0:
        return float(seconds)
    logger.warning("worker report: seconds[%r] = %r is not a copy time; ignored", event_id, seconds)
    return 0.0
