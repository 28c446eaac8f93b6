"""How the engine tells it can make no progress: a waiting head that no later step can
ever run (`step` aborts it), and `drain`, which steps until every finish-time store has
completed, watching counters for a step that did anything, and names what is still
unfinished when it gives up."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.engine.offload_side import OffloadSide
from kvtier.engine.outputs import EngineStats
from kvtier.engine.request import Request
from kvtier.engine.scheduler import Scheduler, SchedulerStep

# Idle steps after a worker flush before `drain` gives up: a real worker reports every
# flushed event at once; the margin covers wrappers that hold reports back a few polls.
_MAX_STALLED_STEPS = 100


class StallChecks:
    """Stall detection, progress description and `drain` (a base of `LLM`, which sets
    these up in its `_start` and provides `step`)."""

    pool: BlockPool
    scheduler: Scheduler
    stats: EngineStats
    offload: OffloadSide | None
    step: Callable[[], list[Request]]

    def drain(self) -> None:
        """Step until every finish-time store has completed.

        Raises RuntimeError, naming what is pending, when the stores can never complete:
        `_MAX_STALLED_STEPS` steps in a row computed nothing, freed no request's blocks
        (a preemption or an idle release), issued no transfer and got no report, though
        the worker was flushed before each one (so it had nothing left to report). Slow
        transfers are waited for, however slow.
        Requests queued by `add_request` run too; those that finish here are returned
        by the next `step`.
        """
        offload = self.offload
        num_stalled = 0
        finished: list[Request] = []
        try:
            while offload is not None and offload.has_pending_work():
                mark = self._progress_mark()
                if num_stalled:
                    offload.flush()  # its poll then reports everything submitted before
                finished += self.step()
                if self._progress_mark() != mark:
                    num_stalled = 0
                    continue
                num_stalled += 1
                if num_stalled > _MAX_STALLED_STEPS:
                    raise RuntimeError(
                        f"drain() made no progress in {_MAX_STALLED_STEPS} steps with an "
                        f"idle offload worker: {offload.describe_pending()} will never "
                        f"complete; {self._describe_unfinished()}"
                    )
        finally:
            self.scheduler.unreturned[:0] = finished

    def _progress_mark(self) -> tuple[int, ...]:
        """Return counters that change whenever a step does anything."""
        stats = self.stats
        marks = (stats.num_computed_tokens, stats.num_preemptions, stats.num_idle_releases)
        if self.offload is None:
            return marks
        totals = self.offload.totals
        return (*marks, totals.num_issued_events, totals.num_reported_events)

    def _describe_unfinished(self) -> str:
        scheduler = self.scheduler
        groups = (
            ("waiting", [r.request_id for r in scheduler.waiting]),
            ("running", [r.request_id for r in scheduler.running]),
            ("loading", list(scheduler.loading)),
        )
        parts = [f"{name}: {', '.join(ids)}" for name, ids in groups if ids]
        return "requests " + "; ".join(parts) if parts else "no request is unfinished"

    def _is_stalled(self, step: SchedulerStep) -> bool:
        """Return True when no later step can run anything: the waiting head never fits.

        Nothing ran, was preempted or is loading, and every GPU block but the head's
        own is free: no request and no transfer (which pins its GPU blocks) can release
        more, so the pool the head failed to fit in cannot grow.
        """
        scheduler = self.scheduler
        if step.work or step.preempted_ids or scheduler.running or scheduler.loading:
            return False
        if not scheduler.waiting:
            return False
        head_blocks = {b for table in scheduler.waiting[0].block_tables for b in table}
        head_blocks.discard(NULL_BLOCK_ID)
        return self.pool.num_free() + len(head_blocks) >= self.pool.num_usable_blocks
