"""Admission policies: which missing blocks a tier stores at all.

Most blocks of real traces are never reused: storing them costs a transfer and evicts a
block that might have been. `door` admits a block on its second sighting within a
window, remembered by a two-generation Bloom filter (`Doorkeeper`).
"""

from __future__ import annotations

from kvtier.core.free_queue import check_num_blocks
from kvtier.core.keys import Key
from kvtier.core.policies.params import check_int_at_least
from kvtier.core.policies.sketch import Doorkeeper

DOORKEEPER_WINDOW_PER_BLOCK = 2


class DoorkeeperAdmission:
    """Admit a key the second time it is offered within about 2-4 x capacity refusals.

    A first sighting is remembered and refused. Only refusals age the filter (an
    admitted offer is not remembered again). Parameter: the window, 2 x the tier's
    usable blocks per Bloom generation (a reuse must come back before about that many
    other first sightings were refused). Memory: about 5 bytes per tier block. O(1)
    per call.
    """

    name = "door"

    def __init__(self, num_blocks: int, window_per_block: int = DOORKEEPER_WINDOW_PER_BLOCK):
        check_num_blocks(num_blocks, type(self).__name__)
        check_int_at_least(window_per_block, "window_per_block", 1)
        self._doorkeeper = Doorkeeper(max(1, num_blocks - 1) * window_per_block)
        self.num_rejected = 0

    def admit(self, key: Key) -> bool:
        """Return True when `key` was offered recently; otherwise remember it and say no."""
        if self._doorkeeper.seen_or_insert(key):
            return True
        self.num_rejected += 1
        return False

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent filter state."""
        self._doorkeeper.check_invariants()
