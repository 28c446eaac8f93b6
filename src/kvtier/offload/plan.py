"""The transfer plan (scheduler → worker) and the worker report (worker → scheduler).

These frozen, picklable records are the only things that cross between the two sides.
They hold block ids and event ids, never tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvtier.core.keys import Key


class Tier(enum.Enum):
    """Where bytes live."""

    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"


@dataclass(frozen=True)
class SlotRecord:
    """What a persistent tier's slot holds once a job wrote it: its primary key and tokens,
    and the token tag of its KV when the token check is on (`kvtier.core.token_tags`)."""

    key: Key
    num_tokens: int
    tag: bytes | None = None


@dataclass(frozen=True)
class TransferJob:
    """Copy whole blocks from one tier to another as one batched transfer.

    `src_block_ids[i]` is copied to `dst_block_ids[i]`; both are in their tier's block id
    space (GPU block ids for the engine's cache, slot ids for a lower tier). Null block
    ids never appear. `event_id` is unique over the scheduler's lifetime, across kinds.
    `dst_records` is set only for jobs into a persistent disk tier: one per destination,
    what the slot will hold, for the tier's manifest. `load_parts` is set on loads issued
    by the scheduler: the number of source blocks (consecutive, in order) of each request
    of `TransferPlan.load_request_ids[event_id]`, so that a worker can tell which requests
    read a bad block (`WorkerReport.bad_blocks`); the copy itself ignores it. See
    `check_load_parts` for what is refused.
    """

    event_id: int
    src_tier: Tier
    dst_tier: Tier
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    dst_records: tuple[SlotRecord, ...] = ()
    load_parts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(
                f"event {self.event_id}: {len(self.src_block_ids)} source blocks but "
                f"{len(self.dst_block_ids)} destination blocks"
            )
        if self.dst_records and len(self.dst_records) != len(self.dst_block_ids):
            raise ValueError(
                f"event {self.event_id}: {len(self.dst_records)} slot records for "
                f"{len(self.dst_block_ids)} destination blocks"
            )
        if self.load_parts:
            self.check_load_parts()
        if self.src_tier is self.dst_tier:
            raise ValueError(
                f"event {self.event_id}: source and destination tier are both {self.src_tier.value}"
            )

    def check_load_parts(self, request_ids: tuple[str, ...] | None = None) -> None:
        """Raise ValueError naming the bad value unless `load_parts` is empty or gives
        each request of a load a block count (an int >= 1) and they add up to the
        source blocks; with `request_ids` (the event's `load_request_ids`), one count
        per request. `__post_init__` checks all but the request ids; a job that crossed
        a process boundary by pickle skipped it, so its reader checks again."""
        parts = self.load_parts
        if not parts:
            return
        if not isinstance(parts, tuple):
            raise ValueError(f"event {self.event_id}: load parts {parts!r} are not a tuple")
        if not self.is_load:
            raise ValueError(
                f"event {self.event_id}: load parts {parts} on a "
                f"{self.src_tier.value} → {self.dst_tier.value} job, not a load"
            )
        for i, size in enumerate(parts):
            if type(size) is not int or size < 1:
                raise ValueError(
                    f"event {self.event_id}: load part {i} of {parts!r} is {size!r}, not a "
                    "block count (an int >= 1)"
                )
        if sum(parts) != len(self.src_block_ids):
            raise ValueError(
                f"event {self.event_id}: load parts {parts} do not add up to "
                f"{len(self.src_block_ids)} source blocks"
            )
        if request_ids is not None and len(request_ids) != len(parts):
            raise ValueError(
                f"event {self.event_id}: {len(parts)} load parts {parts} for "
                f"{len(request_ids)} requests {request_ids}"
            )

    @property
    def is_store(self) -> bool:
        """Return True for a GPU → lower tier copy."""
        return self.src_tier is Tier.GPU

    @property
    def is_load(self) -> bool:
        """Return True for a lower tier → GPU copy."""
        return self.dst_tier is Tier.GPU

    @property
    def num_blocks(self) -> int:
        """Return the number of blocks this job copies."""
        return len(self.src_block_ids)


@dataclass(frozen=True)
class TransferPlan:
    """What the worker must do this step.

    `jobs` run in order of submission per direction. `load_request_ids` maps every
    outstanding load event (issued this step or earlier) to the request ids it serves, so
    a worker can turn a finished event into request ids. `need_flush` means a request was
    preempted this step: the worker must finish every outstanding transfer before the
    forward pass, because preempted GPU blocks may be reused at once.

    `end_persistence` is set on every plan after a tier reset of a persistent disk tier
    (`disk_persist`): before running any job of the plan, every worker drops its disk
    tier's manifest records and records nothing more in this run (idempotent; see
    `DiskTier.end_persistence`). KV stored after a reset may be of other weights than
    the fingerprint names, and KV stored before it must never be found again.

    `forget_slots` names disk slots whose copies the scheduler dropped or never
    registered (see `dropped_slots`): before running any job of the plan, every worker
    with a persistent disk tier drops their manifest records, so a restart does not
    restore them.
    """

    step_id: int
    jobs: tuple[TransferJob, ...] = ()
    load_request_ids: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    need_flush: bool = False
    end_persistence: bool = False
    forget_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for job in self.jobs:
            if job.load_parts:
                request_ids = self.load_request_ids.get(job.event_id)
                if request_ids is None:
                    raise ValueError(
                        f"event {job.event_id}: load parts {job.load_parts} but "
                        "load_request_ids does not list the event"
                    )
                job.check_load_parts(request_ids)

    @property
    def is_empty(self) -> bool:
        """Return True when the plan asks for no transfer, no flush, no end of
        persistence and drops no manifest record."""
        return (
            not self.jobs
            and not self.need_flush
            and not self.end_persistence
            and not self.forget_slots
        )


@dataclass(frozen=True)
class WorkerReport:
    """What one worker (or several, merged) finished since its last report.

    `done[event_id]` and `failed[event_id]` count the workers that finished that event
    successfully or with an error (I/O error, short read/write, checksum mismatch). A
    worker reports each event it was given exactly once, in one of the two maps.
    `seconds[event_id]` is how long a done event's copies took, from when the worker
    started them until they finished (merged: the slowest worker's); it may be absent.
    A failed event with `bad_blocks` may have it too: the time its other blocks took.

    `bad_blocks[event_id]`, for an event in `failed`, names the source block ids whose
    data was bad when every failure counted there knew them (a disk slot that failed its
    checksum or held no valid data): each of those workers then copied every *other*
    source block of the event whole and verified, and has no copy of it still running.
    Absent, every block of the failed event is suspect (an I/O error, a short read, a
    failed copy). Merged: the union, kept only when every report failing the event gave
    its blocks.
    """

    done: Mapping[int, int] = field(default_factory=dict)
    failed: Mapping[int, int] = field(default_factory=dict)
    seconds: Mapping[int, float] = field(default_factory=dict)
    bad_blocks: Mapping[int, frozenset[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """Return True when nothing finished."""
        return not self.done and not self.failed

    @staticmethod
    def merge(reports: Iterable[WorkerReport]) -> WorkerReport:
        """Return one report that sums the worker counts of `reports` (and unites their
        bad blocks where every failure of the event knew its own; see the class)."""
        done: dict[int, int] = {}
        failed: dict[int, int] = {}
        seconds: dict[int, float] = {}
        bad: dict[int, set[int]] = {}
        unknown: set[int] = set()  # failed by a report that does not name its bad blocks
        for report in reports:
            for event_id, value in report.seconds.items():
                seconds[event_id] = max(seconds.get(event_id, 0.0), value)
            for event_id, count in report.done.items():
                done[event_id] = done.get(event_id, 0) + count
            for event_id, count in report.failed.items():
                failed[event_id] = failed.get(event_id, 0) + count
                if not count:
                    continue
                blocks = report.bad_blocks.get(event_id)
                if blocks is None:
                    unknown.add(event_id)
                else:
                    bad.setdefault(event_id, set()).update(blocks)
        bad_blocks = {e: frozenset(b) for e, b in bad.items() if e not in unknown}
        return WorkerReport(done=done, failed=failed, seconds=seconds, bad_blocks=bad_blocks)
