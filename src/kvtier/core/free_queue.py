"""The eviction order of free blocks, as a strategy object.

A block pool keeps every block with ref count 0 (except the null block) in its free
queue. The queue decides which free block is reused next. `LRUFreeQueue` is the default:
an intrusive doubly linked list stored in two `array('i')` (8 bytes per block), so every
operation is O(1) and no Python object exists per block.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Protocol

from kvtier.core.keys import Key


class FreeQueue(Protocol):
    """Eviction order over free block ids. The pool calls it; it never calls the pool."""

    def __len__(self) -> int: ...

    def push_reusable(self, block_id: int) -> None:
        """Add an unhashed free block: it is reused before any cached block."""
        ...

    def push_cached(self, block_id: int) -> None:
        """Add a cached (hashed) free block at the most-recently-used end."""
        ...

    def remove(self, block_id: int) -> None:
        """Take a block out of the queue (it was touched). O(1)."""
        ...

    def discard(self, block_id: int) -> None:
        """Take a free block out whose keys the pool dropped (`BlockPool.discard_keys`).

        Unlike `remove` this is no touch: a policy counts no hit and keeps no ghost for
        it. The pool queues the block again with `push_reusable` right after.
        """
        ...

    def take(self, block_id: int) -> None:
        """Take a free block out for the pool owner's own use (`BlockPool.pin`). O(1).

        Unlike `remove` this is no touch: a policy counts no hit and keeps the block's
        state (its list, frequency). Freed again, `push_cached` queues it at the most
        recent end of that list (LFU-DA: at the priority the current `L` gives it).
        """
        ...

    def evict(self, block_id: int) -> None:
        """Take a free cached block out as its eviction (`BlockPool.evict_keys`).

        What `pop_victim` records for its victim (ghost key, aging) is recorded for this
        block; no hit. The pool drops its keys and queues it with `push_reusable` right
        after.
        """
        ...

    def evict_taken(self, block_id: int) -> None:
        """Record the eviction of a block `take` took out (`BlockPool.release_evicted`).

        As `evict`, from the state the block had when it was taken; it is not queued.
        The pool drops its keys and queues it with `push_reusable` right after.
        """
        ...

    def pop_victim(self) -> int:
        """Remove and return the block to reuse next. The queue is not empty."""
        ...

    def pop_victims(self, num_blocks: int) -> list[int]:
        """Remove and return the next `num_blocks` victims, as `pop_victim` would, in order.

        The queue holds at least `num_blocks` blocks.
        """
        ...

    def push_cached_many(self, block_ids: Sequence[int]) -> None:
        """`push_cached` each of `block_ids`, in order."""
        ...

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        """Yield free blocks in eviction order, starting after `cursor` (head if None).

        The cursor must be in the queue; the queue must not change while iterating.
        """
        ...

    def clear_and_fill(self, block_ids: range) -> None:
        """Make the queue hold exactly `block_ids`, in that order."""
        ...

    def note_key(self, block_id: int, key: Key) -> None:
        """Learn that `block_id` (allocated, not yet freed) now holds `key` as primary key.

        Called by `BlockPool.insert_key`. Policies that remember keys (ghost lists,
        frequency sketches: kvtier.core.policies) use it; idempotent until the block is
        reused.
        """
        ...

    def check_invariants(self) -> None:
        """Raise AssertionError when the queue's own bookkeeping is inconsistent.

        `BlockPool.check_invariants` calls it after checking the queue against the pool:
        links and length, and a policy's lists, ghosts and sketches.
        """
        ...


def check_num_blocks(num_blocks: int, owner: str) -> None:
    """Raise ValueError naming `num_blocks` unless it is an int >= 2 (block 0 is null)."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
        raise ValueError(
            f"{owner} needs num_blocks to be an int >= 2 (block 0 is null), got {num_blocks!r}"
        )


class OneByOne:
    """`pop_victims` and `push_cached_many` as loops over the one-block operations.

    A mixin for eviction policies whose order has no cheaper batched form. Its `discard`
    is `remove`: a policy whose `remove` counts a hit overrides it.
    """

    __slots__ = ()

    def pop_victims(self: FreeQueue, num_blocks: int) -> list[int]:
        """Pop `num_blocks` victims one at a time."""
        pop_victim = self.pop_victim
        return [pop_victim() for _ in range(num_blocks)]

    def push_cached_many(self: FreeQueue, block_ids: Sequence[int]) -> None:
        """Push each block one at a time."""
        push_cached = self.push_cached
        for block_id in block_ids:
            push_cached(block_id)

    def discard(self: FreeQueue, block_id: int) -> None:
        """`remove` the block: this policy's `remove` counts no hit."""
        self.remove(block_id)

    def take(self: FreeQueue, block_id: int) -> None:
        """`remove` the block (a policy whose `remove` counts a hit overrides it)."""
        self.remove(block_id)

    def evict(self: FreeQueue, block_id: int) -> None:
        """`discard` the block (a policy with ghosts or aging overrides it)."""
        self.discard(block_id)

    def evict_taken(self: FreeQueue, block_id: int) -> None:
        """Nothing to record (a policy with ghosts or aging overrides it)."""


class LRUFreeQueue:
    """Least recently freed first; unhashed blocks go to the head."""

    __slots__ = ("_len", "_next", "_prev", "_sentinel")

    def __init__(self, num_blocks: int) -> None:
        check_num_blocks(num_blocks, type(self).__name__)
        # Node `num_blocks` is the sentinel of a circular list: _next[s] is the head and
        # _prev[s] the tail. A block not in the queue has undefined links.
        self._sentinel = num_blocks
        self._next = array("i", bytes(4 * (num_blocks + 1)))
        self._prev = array("i", bytes(4 * (num_blocks + 1)))
        self._next[num_blocks] = num_blocks
        self._prev[num_blocks] = num_blocks
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _insert_after(self, node: int, block_id: int) -> None:
        nxt = self._next[node]
        self._next[block_id] = nxt
        self._prev[block_id] = node
        self._prev[nxt] = block_id
        self._next[node] = block_id
        self._len += 1

    def push_reusable(self, block_id: int) -> None:
        """Add `block_id` at the head."""
        self._insert_after(self._sentinel, block_id)

    def push_cached(self, block_id: int) -> None:
        """Add `block_id` at the tail."""
        sentinel = self._sentinel
        prev = self._prev
        tail = prev[sentinel]
        self._next[block_id] = sentinel
        prev[block_id] = tail
        prev[sentinel] = block_id
        self._next[tail] = block_id
        self._len += 1

    def remove(self, block_id: int) -> None:
        """Unlink `block_id`."""
        prv = self._prev[block_id]
        nxt = self._next[block_id]
        self._next[prv] = nxt
        self._prev[nxt] = prv
        self._len -= 1

    def discard(self, block_id: int) -> None:
        """Unlink `block_id`, as `remove` does: recency counts no hits."""
        self.remove(block_id)

    def take(self, block_id: int) -> None:
        """Unlink `block_id`, as `remove` does (freed again, it is most recent)."""
        self.remove(block_id)

    def evict(self, block_id: int) -> None:
        """Unlink `block_id`, as `remove` does: recency keeps no ghosts."""
        self.remove(block_id)

    def evict_taken(self, block_id: int) -> None:
        """Nothing to record: recency keeps no ghosts."""

    def pop_victim(self) -> int:
        """Unlink and return the head."""
        head = self._next[self._sentinel]
        if head == self._sentinel:
            raise IndexError("free queue is empty")
        self.remove(head)
        return head

    def pop_victims(self, num_blocks: int) -> list[int]:
        """Unlink and return the first `num_blocks` blocks (one relink for the run)."""
        if num_blocks > self._len:
            raise IndexError(f"cannot pop {num_blocks} blocks from a queue of {self._len}")
        sentinel = self._sentinel
        nxt = self._next
        taken = []
        node = sentinel
        for _ in range(num_blocks):
            node = nxt[node]
            taken.append(node)
        after = nxt[node]
        nxt[sentinel] = after
        self._prev[after] = sentinel
        self._len -= num_blocks
        return taken

    def push_cached_many(self, block_ids: Sequence[int]) -> None:
        """Append `block_ids` at the tail, in order (one relink for the run)."""
        if not block_ids:
            return
        sentinel = self._sentinel
        nxt = self._next
        prv = self._prev
        tail = prv[sentinel]
        for block_id in block_ids:
            nxt[tail] = block_id
            prv[block_id] = tail
            tail = block_id
        nxt[tail] = sentinel
        prv[sentinel] = tail
        self._len += len(block_ids)

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        """Yield from after `cursor` (or the head) to the tail."""
        node = self._next[self._sentinel if cursor is None else cursor]
        while node != self._sentinel:
            yield node
            node = self._next[node]

    def note_key(self, block_id: int, key: Key) -> None:
        """Ignore keys: recency alone decides."""

    def check_invariants(self) -> None:
        """Raise AssertionError when the links and the length disagree, or a back link
        (`remove` and `push_cached` follow them) is not the reverse of a forward one."""
        seen = set()
        prev, node = self._sentinel, self._next[self._sentinel]
        while node != self._sentinel:
            assert node not in seen, f"block {node} queued twice"
            back = self._prev[node]
            assert back == prev, f"block {node}: back link {back}, not {prev}"
            seen.add(node)
            assert len(seen) <= len(self), "free queue longer than its length"
            prev, node = node, self._next[node]
        assert self._prev[self._sentinel] == prev, "the tail link is not the last block"
        assert len(seen) == len(self), "free queue shorter than its length"

    @property
    def num_blocks(self) -> int:
        """Return the size of the pool this queue is made for."""
        return self._sentinel

    def clear_and_fill(self, block_ids: range) -> None:
        """Link `block_ids` in order, dropping whatever was queued."""
        s = self._sentinel
        self._next[s] = s
        self._prev[s] = s
        self._len = 0
        for block_id in block_ids:
            self.push_cached(block_id)
