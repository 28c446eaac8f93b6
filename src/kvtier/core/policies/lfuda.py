"""`lfuda`: frequency-aware eviction — LFU with dynamic aging, capped, in F+1 LRU buckets.

Each free cached block has a priority `K = L + min(f, F)`, where `f` is the key's recent
access count (a count-min sketch, aged TinyLFU-style every `10 x capacity` accesses) and
`L` is the priority of the last evicted block (dynamic aging: a block that stops being
used is overtaken by fresher ones after at most F evictions of its level). The victim is
the least recently freed block of the lowest priority. Accesses are stores (`note_key`)
and hits (a touch of a free cached block).

Because every priority lies in [L, L + F], the free blocks fit in F + 1 LRU lists
indexed by `K mod (F + 1)`; `pop_victim` scans at most F + 1 list heads, so every
operation is O(1). With F = 1 the policy is exactly LRU. Parents are accessed at least as
often as their children (every use of a block is a use of its prefix), and blocks of one
request are freed tail-first, so within a priority prefix tails go before their roots.

Parameters (docs/policies.md shows how they were chosen):
- F = `max_frequency`, default 2: a block used at least twice within the aging window
  outlives a block used once by one eviction level. Larger F helps the Mooncake trace a
  little at 1-3 M tokens but lets finished conversations linger in chat workloads.
- the aging period, 10 x capacity accesses (TinyLFU's sample size);
- the sketch width, 8 x capacity counters per row (4 rows): narrower sketches
  over-count at small capacities, where ~10 x capacity distinct keys share them.
Memory per block: 9 bytes of links, 8 bytes of priority, 1 byte of frequency, an 8-byte
key reference and 32 bytes of sketch (about 60 bytes).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from kvtier.core.free_queue import OneByOne, check_num_blocks
from kvtier.core.keys import Key
from kvtier.core.policies.block_lists import BlockLists
from kvtier.core.policies.sketch import CountMinSketch

DEFAULT_MAX_FREQUENCY = 2
AGING_PERIOD_PER_BLOCK = 10
SKETCH_WIDTH_PER_BLOCK = 8


class LFUDAPolicy(OneByOne):
    """Capped LFU with dynamic aging for a pool of `num_blocks` blocks."""

    name = "lfuda"

    def __init__(self, num_blocks: int, max_frequency: int = DEFAULT_MAX_FREQUENCY) -> None:
        check_num_blocks(num_blocks, type(self).__name__)
        self.num_blocks = num_blocks  # the pool's size it is made for
        if isinstance(max_frequency, bool) or not isinstance(max_frequency, int):
            raise ValueError(f"max_frequency must be an int in [1, 15], got {max_frequency!r}")
        if not 1 <= max_frequency <= 15:
            raise ValueError(f"max_frequency must be in [1, 15], got {max_frequency}")
        capacity = max(1, num_blocks - 1)
        self._max_f = max_frequency
        self._num_levels = max_frequency + 1
        self._reusable = self._num_levels  # list id of unhashed blocks
        self._lists = BlockLists(num_blocks, self._num_levels + 1)
        self._keys: list[Key | None] = [None] * num_blocks
        self._freq = array("b", [1]) * num_blocks  # estimate at the block's last access
        self._priority = array("q", [0]) * num_blocks
        self._sketch = CountMinSketch(
            SKETCH_WIDTH_PER_BLOCK * capacity, AGING_PERIOD_PER_BLOCK * capacity
        )
        self.level = 0  # L: the priority of the last evicted block

    def __len__(self) -> int:
        return self._lists.total()

    def note_key(self, block_id: int, key: Key) -> None:
        """Count the store as an access of `key`."""
        if self._keys[block_id] == key:
            return  # already noted (idempotent: the pool and its owner may both call it)
        self._keys[block_id] = key
        self._freq[block_id] = min(self._sketch.add(key), self._max_f)

    def push_reusable(self, block_id: int) -> None:
        """Queue an unhashed block: reused before any cached block."""
        self._keys[block_id] = None
        self._lists.push_head(self._reusable, block_id)

    def push_cached(self, block_id: int) -> None:
        """Queue a cached block at the MRU end of its priority's list."""
        priority = self.level + max(1, self._freq[block_id])
        self._priority[block_id] = priority
        self._lists.push_tail(priority % self._num_levels, block_id)

    def remove(self, block_id: int) -> None:
        """Take a touched block out; a cached one counts as an access."""
        if self._lists.unlink(block_id) != self._reusable:
            key = self._keys[block_id]
            if key is not None:
                self._freq[block_id] = min(self._sketch.add(key), self._max_f)

    def take(self, block_id: int) -> None:
        """Take a free block out without an access: freed again, its priority is re-read
        from the same frequency."""
        self._lists.unlink(block_id)

    def evict(self, block_id: int) -> None:
        """Take a free cached block out as LFU-DA evicts: `L` rises to its priority, or
        to the lowest priority still queued if that is lower (every queued priority
        stays in [L, L + F])."""
        cached = self._lists.where(block_id) != self._reusable
        self.discard(block_id)
        if cached:
            self._age_to(self._priority[block_id])

    def evict_taken(self, block_id: int) -> None:
        """Record the eviction of a taken block: `evict`'s aging, from the priority the
        block had when it was taken."""
        self.forget_taken(block_id)
        self._age_to(self._priority[block_id])

    def forget_taken(self, block_id: int) -> None:
        """Forget a taken block's key without aging (`discard` for a block not queued)."""
        self._keys[block_id] = None
        self._freq[block_id] = 1

    def _age_to(self, priority: int) -> None:
        """Raise `L` to `priority`, or to the lowest priority still queued if lower."""
        lowest = self.peek_cached_victim()
        if lowest is not None:
            priority = min(priority, self._priority[lowest])
        self.level = max(self.level, priority)

    def peek_cached_victim(self) -> int | None:
        """Return the cached block `pop_victim` would take once no unhashed block is
        queued (the LRU one of the lowest priority); None when none is queued."""
        lists = self._lists
        for priority in range(self.level, self.level + self._num_levels):
            head = lists.head(priority % self._num_levels)
            if head is not None:
                return head
        return None

    def pop_victim(self) -> int:
        """Return an unhashed block if any, else the LRU block of the lowest priority."""
        victim = self.peek_victim()
        if self._lists.where(victim) != self._reusable:
            self.level = self._priority[victim]
        self.discard(victim)
        return victim

    def peek_victim(self) -> int:
        """Return the block `pop_victim` would return, leaving it queued."""
        lists = self._lists
        unhashed = lists.head(self._reusable)
        if unhashed is not None:
            return unhashed
        victim = self.peek_cached_victim()
        if victim is None:
            raise IndexError("free queue is empty")
        return victim

    def discard(self, block_id: int) -> None:
        """Take a free block out for reuse without counting an access or aging (`L` stays)."""
        self._lists.unlink(block_id)
        self._keys[block_id] = None
        self._freq[block_id] = 1

    def noted_key(self, block_id: int) -> Key | None:
        """Return the key `note_key` recorded for `block_id` (None for an unhashed block)."""
        return self._keys[block_id]

    def is_reusable(self, block_id: int) -> bool:
        """Return True when `block_id` is queued as an unhashed block."""
        return self._lists.where(block_id) == self._reusable

    def iter_reusable_after(self, cursor: int | None) -> Iterator[int]:
        """Yield the queued unhashed blocks in reuse order, after `cursor` (one of them)."""
        yield from self._lists.iter_list(self._reusable, cursor)

    def _levels_in_order(self) -> list[int]:
        return [p % self._num_levels for p in range(self.level, self.level + self._num_levels)]

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        """Yield free blocks in eviction order: unhashed, then by priority, LRU first."""
        order = [self._reusable, *self._levels_in_order()]
        yield from self._lists.iter_lists_after(order, cursor)

    def clear_and_fill(self, block_ids: range) -> None:
        """Queue exactly `block_ids` as unhashed blocks, reused in that order; keep the sketch."""
        self._lists.clear()
        for block_id in block_ids:
            self._keys[block_id] = None
            self._lists.push_tail(self._reusable, block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError when a priority is outside [L, L + F] or lists disagree."""
        self._lists.check_invariants()
        self._sketch.check_invariants()
        for list_id in range(self._num_levels):
            for block_id in self._lists.iter_list(list_id):
                priority = self._priority[block_id]
                assert self.level <= priority <= self.level + self._max_f, (
                    f"block {block_id}: priority {priority} outside "
                    f"[{self.level}, {self.level + self._max_f}]"
                )
                assert priority % self._num_levels == list_id, f"block {block_id} misfiled"
                assert self._keys[block_id] is not None, f"cached block {block_id} has no key"
        for block_id in self._lists.iter_list(self._reusable):
            assert self._keys[block_id] is None, f"unhashed block {block_id} has a key"
