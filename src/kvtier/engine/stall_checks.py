"""How the engine tells it can make no progress: a waiting head that no later step can
ever run (`step` aborts it), and the counters `drain` watches for a step that did
anything, with what is still unfinished when it gives up."""

from __future__ import annotations

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.engine.offload_side import OffloadSide
from kvtier.engine.outputs import EngineStats
from kvtier.engine.scheduler import Scheduler, SchedulerStep


class StallChecks:
    """Stall detection and progress description (a base of `LLM`, which sets these up
    in its `_start`)."""

    pool: BlockPool
    scheduler: Scheduler
    stats: EngineStats
    offload: OffloadSide | None

    def _progress_mark(self) -> tuple[int, ...]:
        """Return counters that change whenever a step does anything."""
        stats = self.stats
        marks = (stats.num_computed_tokens, stats.num_preemptions)
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
