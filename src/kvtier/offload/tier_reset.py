"""Reset of the lower tiers (SPEC §6.9), and what waits while transfers drain.

A reset drops every key of every tier at once, whatever is in flight: from that call on
no lookup finds anything stored before it. The slots in use by the transfers then
outstanding are freed as those are reported; until the last of them is, the reset is
*pending* (`OffloadScheduler.reset` returns False) and lazy mode's walk and write-back's
demotions pause: both would re-copy what the reset just dropped (before, a caller
retrying the reset every step never saw it succeed, as each step planned a new copy
that the next try abandoned). Stores of requests admitted since (eager steps, finishes,
hand-offs) go on as usual: their KV is computed after the reset. The pending state ends
with the report that drains the last waited-for transfer, so nothing stays paused for a
caller that never retries.

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
        # Events outstanding at the last reset that returned False, until reported.
        self.waiting: set[int] = set()

    @property
    def pending(self) -> bool:
        """Return True while transfers outstanding at the last reset are unreported."""
        return bool(self.waiting)

    def reset(self, selector: StoreSelector) -> bool:
        """Drop everything now; return True once no transfer is outstanding.

        Never-issued transfers are dropped (their loads come back as failed loads in the
        next report); issued stores and demotions are abandoned and never become visible.
        Requests running across the reset are no longer stored: their KV, and all they
        compute from it, predates the reset (e.g. a weight update), so none of it may
        reach the emptied tier. A request preempted and resumed starts afresh. Eager
        mode only: lazy mode's walk stores any free GPU block the engine's prefix cache
        still holds by its key, as the engine's own cache still serves it (an engine
        that resets its GPU cache too leaves the walk no key; one whose reset failed
        retries, emptying the tier again).
        """
        loads = self._loads
        # A pin's request is looked up, or allocated once `on_allocated` consumes the pin.
        selector.across_reset |= set(selector.tracked) | loads.allocated | loads.looked_up
        loads.fail_all()
        selector.release(selector.take_queued())
        if selector.set_aside is not None:  # a disk-only tier's slots of failed stores
            selector.set_aside.clear()
        selector.tracked.clear()
        if self._tags is not None:
            self._tags.clear()
        selector.lazy.clear()
        selector.loaded.clear()
        if self._cascade is not None:
            self._cascade.release(self._cascade.take_queued())
            self._cascade.forget_all()
        self._book.abandon_stores()
        for transfer in self._book:  # their keys may be stored afresh: let them go now
            selector.in_flight_keys.difference_update(transfer.stores.keys)
            if self._cascade is not None:
                self._cascade.in_flight_keys.difference_update(m.key for m in transfer.moves)
        self.waiting = {transfer.job.event_id for transfer in self._book}
        if self.waiting:  # the slots wait for their transfers; the keys go now
            for pool in self._index.pools.values():
                pool.discard_all_keys()
            return False
        for pool in self._index.pools.values():
            cleared = pool.reset()  # AllCleared
            assert cleared, "tier blocks referenced with no transfer outstanding"
        return True

    def note_report(self) -> None:
        """Forget the waited-for transfers a report completed (after each report)."""
        if self.waiting:
            self.waiting = {event_id for event_id in self.waiting if event_id in self._book}

    def check_invariants(self) -> None:
        """Raise AssertionError when a pending reset waits for a transfer already reported."""
        assert all(event_id in self._book for event_id in self.waiting), (
            "a pending reset waits for a transfer already reported"
        )
