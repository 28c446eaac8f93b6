"""Disk slots that failed writes went into, set aside so that a bad slot (a bad sector:
every write into it fails) is not the first slot handed out again and again.

Disk slots are written by demotions (CPU → DISK, in a cascade) and, with a disk-only
tier, by stores (GPU → DISK). A failed write's disk slots are unhashed when freed, and the
pool reuses unhashed blocks first: the next job got the same slots back, so one bad slot
failed every later job (a job fails as a whole) and the disk tier stored nothing more. A
failed job does not say which of its slots failed, so `SetAsideSlots` holds them all
(one reference each, out of the free queue) as *suspects*.

A later write job that succeeds shows the disk works: suspects are given back to the pool
*on trial*, at most `trial_size` at a time and one group at a time. A trial slot that a
successful job wrote into is cleared, and a group that passed doubles the trial
size. A failed job with several trial slots halves the trial size and puts them back
first, so the next trials bisect them; a failed job with one trial slot found a bad
slot, held until a reset. Slots in a failed job that were
not on trial become suspects.

Held slots cost disk capacity only: when a job finds fewer free disk blocks than it
needs, every held slot is given back on trial (a disk that fails every write still gets
its writes tried, and never runs out of room), and a reset gives them all back.

Host memory (a CPU tier) has no such slots: a failed CPU store is a worker's error, not
its slot's, so CPU slots are freed as before.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from kvtier.core.block_pool import BlockPool

logger = logging.getLogger(__name__)

_ALL = sys.maxsize  # a trial size that gives every suspect back at once


class SetAsideSlots:
    """The disk slots of failed write jobs, held out of the disk pool's free queue."""

    def __init__(self, disk_pool: BlockPool) -> None:
        self.disk_pool = disk_pool
        self.suspects: list[int] = []  # failed once: given back once the disk works
        self.bad: list[int] = []  # failed alone on trial: held until a reset
        self.on_trial: set[int] = set()  # given back, not yet written successfully
        self.trial_size = _ALL

    def __len__(self) -> int:
        return len(self.suspects) + len(self.bad)

    def held(self) -> list[int]:
        """Return every slot held (each has one reference)."""
        return [*self.suspects, *self.bad]

    def note_failed(self, slots: Sequence[int]) -> None:
        """Hold the slots of a failed write job (not freed to the pool)."""
        on_trial = self.on_trial
        trial = [slot for slot in slots if slot in on_trial]
        fresh = [slot for slot in slots if slot not in on_trial]
        on_trial.difference_update(trial)
        self.suspects.extend(fresh)
        if len(trial) == 1:
            self.bad.append(trial[0])
            self.trial_size = _ALL
            logger.warning(
                "disk slot %d: a write into it failed again alone; set aside until "
                "a reset (a bad sector?)",
                trial[0],
            )
        elif trial:
            self.trial_size = max(1, len(trial) // 2)
            self.suspects[:0] = trial  # tried first, in halves

    def note_succeeded(self, slots: Sequence[int]) -> None:
        """Clear the trial slots a successful write job wrote into; once no trial is
        pending, give the next group of suspects back on trial."""
        on_trial = self.on_trial
        if on_trial:
            on_trial.difference_update(slots)
            if not on_trial:  # the group passed: the next may be twice as large
                self.trial_size = min(_ALL, 2 * self.trial_size)
        if self.suspects and not on_trial:
            group = self.suspects[: self.trial_size]
            del self.suspects[: len(group)]
            self._give_back(group)

    def make_room(self, needed: int) -> None:
        """Give every held slot back on trial when fewer than `needed` disk blocks are free."""
        if (self.suspects or self.bad) and self.disk_pool.num_free() < needed:
            held = self.held()
            self.suspects.clear()
            self.bad.clear()
            self.trial_size = _ALL
            self._give_back(held)

    def clear(self) -> None:
        """Give every held slot back, none on trial (a reset empties the disk tier)."""
        held = self.held()
        self.suspects.clear()
        self.bad.clear()
        self.on_trial.clear()
        self.trial_size = _ALL
        self.disk_pool.free(held[::-1])

    def _give_back(self, slots: list[int]) -> None:
        self.on_trial.update(slots)
        self.disk_pool.free(slots[::-1])  # unhashed: reused first, in this order

    def check_invariants(self) -> None:
        """Raise AssertionError when a held slot is cached, free or counted twice."""
        held = self.held()
        assert len(set(held)) == len(held), "a disk slot set aside twice"
        assert not self.on_trial.intersection(held), "a held disk slot is on trial"
        for slot in held:
            assert self.disk_pool.key(slot) is None, f"held disk slot {slot} holds a key"
            assert self.disk_pool.ref_count(slot) >= 1, f"held disk slot {slot} is free"
