"""What an eviction policy and an admission policy of a tier are (protocols).

An **eviction policy** is a `FreeQueue` (core/free_queue.py): the pool calls it to queue
and pick free blocks, and tells it which primary key a freshly stored block holds
(`note_key`, called by `BlockPool.insert_key`), which policies that remember keys (ghost
lists, frequency sketches) use. Policies with no cheaper batched form inherit
`pop_victims` and `push_cached_many` from `OneByOne`.

An **admission policy** decides whether a block that is not in the tier is stored at all.
The offload scheduler asks it during store selection, after the "already cached" check
and before allocating a slot.

Neither calls the pool back. Both are single-threaded, owned by whoever owns the pool.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvtier.core.free_queue import FreeQueue
from kvtier.core.keys import Key


class EvictionPolicy(FreeQueue, Protocol):
    """A `FreeQueue` that also learns the primary key of each stored block."""

    name: str

    def note_key(self, block_id: int, key: Key) -> None:
        """Record that `block_id` (allocated, not yet freed) now holds `key`.

        Idempotent until the block is reused: a second call with the same key is a no-op.
        """
        ...


class AdmissionPolicy(Protocol):
    """Decide whether a block missing from the tier is worth storing."""

    name: str

    def admit(self, key: Key) -> bool:
        """Return True to store the block holding `key`; may update the policy's state."""
        ...

    def check_invariants(self) -> None:
        """Raise AssertionError when the policy's bookkeeping is inconsistent."""
        ...


@runtime_checkable
class RequestObserver(Protocol):
    """A policy that wants to know which trace request is being replayed (offline oracles)."""

    def on_request(self, index: int) -> None:
        """Called by the replay before request `index` touches the tier."""
        ...


class AdmitAll:
    """Store every candidate (`all`, the default admission policy)."""

    name = "all"

    def admit(self, key: Key) -> bool:
        """Return True."""
        return True

    def check_invariants(self) -> None:
        """Nothing to check."""
