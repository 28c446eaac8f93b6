"""Bookkeeping of issued transfers: completion counting across workers, abandonment."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtier.offload.cascade import MoveItem
from kvtier.offload.plan import Tier, TransferJob, WorkerReport
from kvtier.offload.store_selection import StoreItem


@dataclass(frozen=True)
class FailedLoad:
    """A load that will not happen: the engine must recompute tokens [start, end)."""

    request_id: str
    start_token: int
    end_token: int


@dataclass(frozen=True)
class ReportOutcome:
    """What the engine must act on after `apply_report`."""

    finished_loads: tuple[str, ...] = ()
    failed_loads: tuple[FailedLoad, ...] = ()


@dataclass(slots=True)
class LoadProgress:
    """One request's load over one or more tiers: parts still to finish, any failure."""

    request_id: str
    start_token: int
    end_token: int
    num_pending: int
    failed: bool = False

    def failure(self) -> FailedLoad:
        """Return the failed load of the whole range (conservative across tiers)."""
        return FailedLoad(self.request_id, self.start_token, self.end_token)


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
    stores: list[StoreItem] = field(default_factory=list)
    moves: list[MoveItem] = field(default_factory=list)
    num_done: int = 0
    num_failed: int = 0
    abandoned: bool = False

    @property
    def succeeded(self) -> bool:
        """Return True when no worker failed the event."""
        return self.num_failed == 0


class TransferBook:
    """Issued transfers by event id; an event completes once every worker reported it."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._issued: dict[int, IssuedTransfer] = {}
        self._last_event_id = 0
        self._unissued_failures: list[FailedLoad] = []

    def next_event_id(self) -> int:
        """Return a new event id; ids never repeat, not even after a reset."""
        self._last_event_id += 1
        return self._last_event_id

    def issue(self, transfer: IssuedTransfer) -> None:
        """Record an issued event."""
        self._issued[transfer.job.event_id] = transfer

    def fail_unissued(self, failure: FailedLoad) -> None:
        """Queue a load failure that never reached a worker, for the next report."""
        self._unissued_failures.append(failure)

    def take_unissued_failures(self) -> list[FailedLoad]:
        """Return and forget the queued failures."""
        failures, self._unissued_failures = self._unissued_failures, []
        return failures

    def complete(self, report: WorkerReport) -> list[IssuedTransfer]:
        """Add a report's worker counts; return the events that are now complete.

        Unknown event ids (from before a reset, or reported twice) are ignored.
        """
        touched: list[IssuedTransfer] = []
        for counts, failed in ((report.done, False), (report.failed, True)):
            for event_id, count in counts.items():
                transfer = self._issued.get(event_id)
                if transfer is None:
                    continue
                if failed:
                    transfer.num_failed += count
                else:
                    transfer.num_done += count
                touched.append(transfer)
        completed = []
        for transfer in touched:
            event_id = transfer.job.event_id
            num_reported = transfer.num_done + transfer.num_failed
            if event_id in self._issued and num_reported >= self.num_workers:
                completed.append(self._issued.pop(event_id))
        return completed

    def abandon_stores(self) -> None:
        """Mark every issued store and demotion abandoned: it will never become visible."""
        for transfer in self._issued.values():
            if transfer.stores or transfer.moves:
                transfer.abandoned = True

    def load_request_ids(self) -> dict[int, tuple[str, ...]]:
        """Return every outstanding load event with the request ids it serves."""
        return {
            event_id: tuple(item.request_id for item in transfer.loads)
            for event_id, transfer in self._issued.items()
            if transfer.job.is_load
        }

    def __iter__(self) -> Iterator[IssuedTransfer]:
        return iter(self._issued.values())

    def __len__(self) -> int:
        return len(self._issued)

    def has_stores(self) -> bool:
        """Return True while any store or demotion (abandoned ones too) is in flight."""
        return any(transfer.stores or transfer.moves for transfer in self._issued.values())
