"""Reset of the lower tiers (SPEC §6.9), and the pause of new copies while one waits.

A reset drops every key of every tier at once, whatever is in flight: from that call on
no lookup finds anything stored before it. The slots themselves are freed once the
transfers still using them are reported; until then the reset is *pending*
(`OffloadScheduler.reset` returns False) and no store or demotion is planned, so that a
caller retrying the reset every step sees it succeed once the old transfers drain
(before, lazy mode re-selected the blocks whose stores the last attempt abandoned, and
write-back demoted another block each step: the retries never ended). The first report
that leaves nothing outstanding completes the reset by itself, so copying resumes even
for a caller that never retries.

**Beyond** SPEC §6.9, which leaves the index in place until a retry succeeds: a caller
that ignores the False (vLLM's `reset_prefix_cache` returns a bool) would be served KV
from before, e.g. from old weights.
"""

from __future__ import annotations

from kvtier.offload.cascade import Cascade
from kvtier.offload.load_planner import LoadPlanner
from kvtier.offload.request_tags import RequestTags
from kvtier.offload.store_selection import StoreSelector
from kvtier.offload.tier_index import TierIndex
from kvtier.offload.transfers import TransferBook


class TierReset:
    """Drops the tiers' contents; `pending` while issued transfers still use their slots."""

    def __init__(
        self,
        index: TierIndex,
        book: TransferBook,
        loads: LoadPlanner,
        cascade: Cascade | None,
        tags: RequestTags | None,
    ) -> None:
        self._index = index
        self._book = book
        self._loads = loads
        self._cascade = cascade
        self._tags = tags
        self.pending = False  # keys dropped, slots waiting for outstanding transfers

    def reset(self, selector: StoreSelector) -> bool:
        """Drop everything now; return True once no transfer is outstanding.

        Never-issued transfers are dropped (their loads come back as failed loads in the
        next report); issued stores and demotions are abandoned and never become visible.
        Requests running across the reset are no longer stored: their KV, and all they
        compute from it, predates the reset (e.g. a weight update), so none of it may
        reach the emptied tier. A request preempted and resumed starts afresh.
        """
        loads = self._loads
        selector.across_reset |= set(selector.tracked) | loads.allocated | set(loads.pins)
        loads.fail_all()
        selector.release(selector.take_queued())
        selector.tracked.clear()
        if self._tags is not None:
            self._tags.clear()
        selector.lazy.clear()
        if self._cascade is not None:
            self._cascade.release(self._cascade.take_queued())
            self._cascade.dropped.clear()
        self._book.abandon_stores()
        self.pending = True
        if len(self._book):  # the slots wait for their transfers; the keys go now
            for pool in self._index.pools.values():
                pool.discard_all_keys()
        return self.finish_if_drained()

    def finish_if_drained(self) -> bool:
        """Complete a pending reset once nothing is outstanding (after each report);
        return True when no reset is pending."""
        if self.pending and not len(self._book):
            for pool in self._index.pools.values():
                cleared = pool.reset()  # AllCleared
                assert cleared, "tier blocks referenced with no transfer outstanding"
            self.pending = False
        return not self.pending

    def check_invariants(self) -> None:
        """Raise AssertionError when a pending reset has nothing to wait for, or a tier
        holds a key while it waits (nothing is stored meanwhile)."""
        if self.pending:
            assert len(self._book), "a pending reset with nothing outstanding"
            for pool in self._index.pools.values():
                assert not pool.index, "a key visible while a reset waits"
