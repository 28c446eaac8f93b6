"""Checks of what the scheduler issues and what workers report, before either is
counted (`TransferBook.issue`, `TransferBook.complete`): each raises ValueError naming
the bad value, and nothing is applied."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.offload.plan import TransferJob, WorkerReport

if TYPE_CHECKING:
    from kvtier.offload.transfers import LoadItem


def check_load_parts(job: TransferJob, loads: Sequence[LoadItem]) -> None:
    """Raise ValueError when a load event's `load_parts` are not its loads' block counts
    in order, or its source blocks not their tier blocks (workers would fail the wrong
    requests)."""
    sizes = tuple(len(item.tier_block_ids) for item in loads)
    if job.load_parts != sizes:
        raise ValueError(
            f"event {job.event_id}: load parts {job.load_parts} are not the block counts "
            f"{sizes} of its loads {[item.request_id for item in loads]}"
        )
    if job.src_block_ids != tuple(b for item in loads for b in item.tier_block_ids):
        raise ValueError(f"event {job.event_id}: source blocks are not its loads' tier blocks")


def check_report_counts(report: WorkerReport) -> None:
    """Raise ValueError naming the first event whose worker count is not an int >= 0, or
    whose bad blocks are not a frozenset of ints of an event the report fails."""
    for name, counts in (("done", report.done), ("failed", report.failed)):
        for event_id, count in counts.items():
            if type(count) is not int or count < 0:
                raise ValueError(
                    f"worker report: {name}[{event_id!r}] = {count!r} is not a worker "
                    "count (an int >= 0); report refused"
                )
    for event_id, blocks in report.bad_blocks.items():
        if not report.failed.get(event_id):
            raise ValueError(
                f"worker report: bad_blocks names event {event_id!r}, which it does not "
                "fail; report refused"
            )
        if not isinstance(blocks, frozenset) or any(type(b) is not int for b in blocks):
            raise ValueError(
                f"worker report: bad_blocks[{event_id!r}] = {blocks!r} is not a frozenset "
                "of block ids; report refused"
            )
