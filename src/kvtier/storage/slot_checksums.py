"""`SlotChecksums`: a disk tier's per-slot xxh3 checksums and which slots hold valid data.

A store's checksums are computed by the thread that filled its staging buffer, a load's
verified by the thread that consumes it (the rows are hot in their caches); the tier's
I/O threads only read and write. A slot whose last write failed, or that was never
written, holds no valid data.
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvtier.core.plural import counted
from kvtier.storage.slot_file import BadSlotsError


class SlotChecksums:
    """Hold each slot's 64-bit xxh3 checksum of its last successful write, and its validity."""

    def __init__(self, num_slots: int, bytes_per_slot: int) -> None:
        """Start with every slot invalid."""
        self.bytes_per_slot = bytes_per_slot
        self.sums = np.zeros(num_slots, dtype=np.uint64)
        self.valid = np.zeros(num_slots, dtype=np.bool_)

    def restore(self, slot: int, checksum: int) -> None:
        """Mark `slot` valid with `checksum` (a persistent tier's recovered record)."""
        self.sums[slot] = checksum
        self.valid[slot] = True

    def compute(self, memory: memoryview, num_rows: int) -> np.ndarray:
        """Return the checksums of rows `0..num_rows` of a staging buffer's `memory`."""
        size = self.bytes_per_slot
        return np.array(
            [xxhash.xxh3_64_intdigest(memory[i * size : (i + 1) * size]) for i in range(num_rows)],
            dtype=np.uint64,
        )

    def invalidate(self, slot_ids: np.ndarray) -> None:
        """Mark `slot_ids` invalid (a write to them is starting)."""
        self.valid[slot_ids] = False

    def written(self, slot_ids: np.ndarray, sums: np.ndarray) -> None:
        """Mark `slot_ids` valid with `sums` (their write succeeded)."""
        self.sums[slot_ids] = sums
        self.valid[slot_ids] = True

    def find_bad(
        self, memory: memoryview, slot_ids: np.ndarray
    ) -> tuple[dict[int, str], list[int]]:
        """Check every slot of a finished read into `memory`; return each bad slot's
        problem (no valid data, or a checksum mismatch) and the mismatched slots."""
        size = self.bytes_per_slot
        problems: dict[int, str] = {}
        mismatched: list[int] = []
        for i, slot in enumerate(slot_ids.tolist()):
            if not self.valid[slot]:
                problems.setdefault(slot, f"slot {slot} holds no valid data")
                continue
            actual = xxhash.xxh3_64_intdigest(memory[i * size : (i + 1) * size])
            if actual != int(self.sums[slot]):
                mismatched.append(slot)
                problems.setdefault(slot, f"checksum mismatch in slot {slot}")
        return problems, mismatched


def bad_slots_error(problems: dict[int, str], path: str) -> BadSlotsError:
    """Return the error naming every bad slot of one read of the file at `path`."""
    first = min(problems)
    more = ""
    if len(problems) > 1:
        more = f" (and {counted(len(problems) - 1, 'more bad slot')} in this read)"
    return BadSlotsError(problems, problems[first] + more, path)
