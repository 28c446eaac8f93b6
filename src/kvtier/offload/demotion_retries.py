"""Write-through retries of failed CPU → DISK demotions: which are due, and when.

Write-through demotes a block only when the CPU tier registers it, so a failed demotion
would never be tried again (the block lost at its CPU eviction, however short the disk
fault). `WriteThroughRetries`, a mixin of `Cascade`, remembers each failed (CPU block,
key) pair with its attempts so far and demotes it again on a later plan: right away once a
demotion succeeds, else after a back-off of 2, 4, 8 ... plans (at most `_MAX_BACKOFF`)
that doubles with each failed report in a row, and at most `MAX_DEMOTION_ATTEMPTS` times in
all. A retry in flight waits in `retrying`, apart, so plans do not walk it again.

A write-through demotion dropped for want of a free disk slot (every one pinned by moves,
loads or set aside) waits among the retries too, with no attempt spent: it was never
written, so it neither backs off nor uses up an attempt, and a later plan demotes it once
disk slots free up (lost at its CPU eviction otherwise, however soon the disk had room).
So does one skipped because its key was in flight already: that copy may be another
CPU block's whose keys were discarded since (a failed load), and register nothing.

A plan issues at most `retries_per_plan` retries, fewer when fewer disk slots are free (none while
every slot is pinned: then the plan costs no walk at all); the rest stay due for the next
plans. When the disk works again after a long fault as many retries as the CPU tier holds
blocks are due at once: issued in one plan they were a write storm as large as the CPU
tier, competing with loads, and their walk cost a plan O(all pending). A plan walks the
pending retries lazily, in order, and stops at its bound (or `_VISIT_SPAN` times it, past
retries whose key is in flight); those it looked at and did not issue go to the back, so
one plan's work is O(issued) and every retry gets its turn.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.offload.disk_slots import SetAsideSlots

if TYPE_CHECKING:
    from kvtier.offload.demotion_completion import MoveItem

# Demotions of one (CPU block, key), the first included, before giving up.
MAX_DEMOTION_ATTEMPTS = 3
# The most plans a retry waits after failed demotions in a row.
_MAX_BACKOFF = 32
# A plan looks at most this many times its bound of pending retries.
_VISIT_SPAN = 4


class WriteThroughRetries(ABC):
    """The retry state and choices of a `Cascade`, over the state its `__init__` sets up."""

    cpu_pool: BlockPool
    disk_pool: BlockPool
    set_aside: SetAsideSlots
    retries_per_plan: int
    queued: list[MoveItem]
    in_flight_keys: set[Key]
    retry: dict[tuple[int, Key], int]
    retrying: dict[tuple[int, Key], int]
    _num_plans: int
    _retry_at: int
    _failures_in_a_row: int

    @abstractmethod
    def _demote(self, cpu_block_ids: Iterable[int]) -> None:
        """Queue demotions of `cpu_block_ids` (`Cascade._demote` implements it)."""

    def select_retries(self) -> None:
        """Write-through: demote again the blocks whose demotion failed or was dropped,
        once due, at most `retries_per_plan` of them (fewer with fewer disk slots to write
        into).

        Called once per plan (the back-off counts plans). A retry in flight is not
        issued twice (`in_flight_keys`); one whose key is on disk by now is dropped.
        """
        self._num_plans += 1
        retry = self.retry
        if not retry or self._num_plans < self._retry_at:
            return
        # Held slots count: `_demote` gives them back when it finds too few free.
        bound = min(self.retries_per_plan, self.disk_pool.num_free() + len(self.set_aside))
        if bound < 1:  # every disk slot pinned: the reports that free one come first
            return
        in_flight, num_queued = self.in_flight_keys, len(self.queued)
        visited: list[tuple[int, Key]] = []
        chosen: list[int] = []
        for pair in retry:  # lazily: stops at the bound, so O(issued), not O(pending)
            visited.append(pair)
            if pair[1] not in in_flight:
                chosen.append(pair[0])
                if len(chosen) == bound:
                    break
            if len(visited) == _VISIT_SPAN * bound:
                break
        self._demote(chosen)
        for item in self.queued[num_queued:]:  # issued: they wait apart until reported
            if (pair := (item.cpu_block_id, item.key)) in retry:
                self.retrying[pair] = retry.pop(pair)
        for pair in visited:  # looked at, still waiting: behind the others
            if pair in retry:
                retry[pair] = retry.pop(pair)

    def _note_failed_write_through(
        self, items: Sequence[MoveItem], retried: dict[tuple[int, Key], int]
    ) -> None:
        """Mark failed write-through demotions for a retry, unless that was their last
        attempt, and push the next retry back. `retried`: earlier attempts of retries."""
        key, retry = self.cpu_pool.key, self.retry
        for item in items:
            pair = (item.cpu_block_id, item.key)
            if key(item.cpu_block_id) != item.key:
                retry.pop(pair, None)
                continue
            attempts = retried.get(pair, retry.get(pair, 0)) + 1
            if attempts < MAX_DEMOTION_ATTEMPTS:
                retry[pair] = attempts
            else:  # given up: lost if the CPU tier evicts it
                retry.pop(pair, None)
        self._failures_in_a_row += 1
        backoff = min(1 << min(self._failures_in_a_row, 16), _MAX_BACKOFF)
        self._retry_at = self._num_plans + backoff

    def _reported_retries(self, items: Sequence[MoveItem]) -> dict[tuple[int, Key], int]:
        """Take the retries among reported `items` out of `retrying`: pair → attempts."""
        attempts: dict[tuple[int, Key], int] = {}
        for pair in [(i.cpu_block_id, i.key) for i in items] if self.retrying else ():
            if pair in self.retrying:
                attempts[pair] = self.retrying.pop(pair)
        return attempts
