"""Disk slots whose copies the scheduler dropped or declined, for a persistent tier's manifest.

A persistent disk tier (`disk_persist`) records what each written slot holds, and a
restart indexes every record it finds (`Registrar.restore`). The scheduler drops disk
copies the worker cannot see: a failed load's suspect blocks, copies the token check
replaced, a demotion it did not register (its CPU source lost its keys to a failed load
while it moved: the bytes are suspect too), a failed store or demotion (another worker
may have written its slots). Each such slot is noted here, and the next plan carries it
(`TransferPlan.forget_slots`): the workers drop its record before the plan's jobs run,
so a later write of the slot is recorded after the drop, and a restart never offers a
key the scheduler let go. The reference engine, whose worker runs in its process, hands
the slots over right after the report that dropped them (`OffloadSide.poll`): a kill
before its next step leaves no record of them. What no plan carried by shutdown is
handed over then.
"""

from __future__ import annotations

from collections.abc import Iterable


class DroppedSlots:
    """The disk slots to drop from the manifest with the next plan (insertion order)."""

    def __init__(self, active: bool) -> None:
        self.active = active  # persisting: a reset ends it (every record is dropped then)
        self._slots: dict[int, None] = {}

    def add(self, slots: Iterable[int]) -> None:
        """Note disk slots whose records must go (nothing while not persisting)."""
        if self.active:
            self._slots.update(dict.fromkeys(slots))

    def take(self) -> tuple[int, ...]:
        """Return and forget the slots noted since the last call."""
        slots = tuple(self._slots)
        self._slots.clear()
        return slots

    def stop(self) -> None:
        """Note nothing more: a reset ended persistence (every record is dropped)."""
        self.active = False
        self._slots.clear()

    def __len__(self) -> int:
        return len(self._slots)
