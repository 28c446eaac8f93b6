"""`s3fifo`: S3-FIFO (Yang et al., SOSP '23) over a block pool.

A small FIFO S (10 % of the pool) is the probation area for newly stored blocks; a main
FIFO M holds blocks that proved useful; a ghost FIFO G remembers keys evicted from S
(as many as M can hold). A store whose key is in G goes straight to M. Eviction takes
from S while S holds at least its share, else from M, where a block with its frequency
bit set is moved to the tail with the bit cleared (one more round) instead of evicted.

Pool adaptation: a block cannot stay queued while pinned, so a hit re-queues it when it
is freed: a block hit while in S moves to M (the algorithm would move it there when it
reached S's head anyway); a block hit while in M goes to M's tail with its frequency
bit set. Sizes count free blocks only.

Cost: amortised O(1) per operation (each re-queue in M clears a bit). Memory per block:
9 bytes of links, 2 bytes of state and an 8-byte key reference; per ghost key about
100 bytes.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain, islice

from kvtier.core.free_queue import OneByOne, check_num_blocks
from kvtier.core.keys import Key
from kvtier.core.policies.block_lists import BlockLists

_REUSABLE, _SMALL, _MAIN = 0, 1, 2
SMALL_FRACTION = 0.1


class S3FIFOPolicy(OneByOne):
    """S3-FIFO eviction order for a pool of `num_blocks` blocks."""

    name = "s3fifo"

    def __init__(self, num_blocks: int) -> None:
        check_num_blocks(num_blocks, type(self).__name__)
        self.num_blocks = num_blocks  # the pool's size it is made for
        self._lists = BlockLists(num_blocks, 3)
        capacity = max(1, num_blocks - 1)
        self._small_target = max(1, int(capacity * SMALL_FRACTION))
        self._ghost_capacity = max(1, capacity - self._small_target)
        self._keys: list[Key | None] = [None] * num_blocks
        self._dest = array("b", [_SMALL]) * num_blocks  # where the block goes when freed
        self._freq = array("b", [0]) * num_blocks
        self._ghost: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return self._lists.total()

    def note_key(self, block_id: int, key: Key) -> None:
        """Send the block to M if its key is a ghost, else to S."""
        if self._keys[block_id] == key:
            return  # already noted (idempotent: the pool and its owner may both call it)
        self._keys[block_id] = key
        self._freq[block_id] = 0
        ghost = self._ghost
        if key in ghost:
            del ghost[key]
            self._dest[block_id] = _MAIN
        else:
            self._dest[block_id] = _SMALL
        while len(ghost) > self._ghost_capacity:
            ghost.popitem(last=False)

    def push_reusable(self, block_id: int) -> None:
        """Queue an unhashed block: reused before any cached block."""
        self._keys[block_id] = None
        self._lists.push_head(_REUSABLE, block_id)

    def push_cached(self, block_id: int) -> None:
        """Queue a cached block at the tail of S or M."""
        self._lists.push_tail(self._dest[block_id], block_id)

    def remove(self, block_id: int) -> None:
        """Take a touched block out; a cached one counts as a hit (→ M when freed)."""
        where = self._lists.unlink(block_id)
        if where == _SMALL:
            self._dest[block_id] = _MAIN
        elif where == _MAIN:
            self._freq[block_id] = 1

    def discard(self, block_id: int) -> None:
        """Take a free block out whose keys the pool dropped: no hit, no ghost."""
        self._lists.unlink(block_id)
        self._forget(block_id)

    def take(self, block_id: int) -> None:
        """Take a free block out without a hit: freed again, it rejoins its FIFO.

        Taken from M while `pop_victim` would take from M, the blocks ahead of it get
        their second-chance round first, as in `evict` (a pin is taken on the next
        victims, to evict them: `evict_taken`).
        """
        self._give_rounds(block_id)
        self._lists.unlink(block_id)

    def evict(self, block_id: int) -> None:
        """Take a free cached block out as S3-FIFO evicts: from S, its key joins the ghost.

        From M while `pop_victim` would take from M, the blocks at M's head with their
        frequency bit set (this one too) first get the round `pop_victim` gives them on
        its way (bit cleared, moved to the tail; amortised O(1)), so evicting the next
        victim this way changes exactly what `pop_victim` would.
        """
        self._give_rounds(block_id)
        if self._lists.unlink(block_id) == _SMALL:
            self._remember(block_id)
        self._forget(block_id)

    def _give_rounds(self, block_id: int) -> None:
        """If `pop_victim` would take from M and `block_id` is in M: clear the bits of
        the blocks at M's head and move them to the tail, up to a block without one."""
        lists = self._lists
        if lists.where(block_id) != _MAIN or self._takes_from_small():
            return
        freq = self._freq
        head = lists.head(_MAIN)
        while head is not None and freq[head]:  # stops: every round clears a bit
            freq[head] = 0
            lists.unlink(head)
            lists.push_tail(_MAIN, head)
            head = lists.head(_MAIN)

    def evict_taken(self, block_id: int) -> None:
        """Record the eviction of a taken block: from S, its key joins the ghost (M's
        rounds were given when it was taken)."""
        if self._dest[block_id] == _SMALL:
            self._remember(block_id)
        self._forget(block_id)

    def _takes_from_small(self) -> bool:
        lists = self._lists
        return lists.length(_SMALL) >= self._small_target or not lists.length(_MAIN)

    def _remember(self, victim: int) -> None:
        key = self._keys[victim]
        if key is not None:
            self._ghost[key] = None  # trimmed at the next store, after its look-up
            if len(self._ghost) > 2 * self._ghost_capacity:
                self._ghost.popitem(last=False)

    def _forget(self, victim: int) -> None:
        self._keys[victim] = None
        self._dest[victim] = _SMALL
        self._freq[victim] = 0

    def pop_victim(self) -> int:
        """Return an unhashed block if any, else S-3FIFO's victim."""
        lists = self._lists
        if lists.length(_REUSABLE):
            return lists.pop_head(_REUSABLE)
        if self._takes_from_small():
            if not lists.length(_SMALL):
                raise IndexError("free queue is empty")
            victim = lists.pop_head(_SMALL)
            self._remember(victim)
        else:
            freq = self._freq
            while True:
                victim = lists.pop_head(_MAIN)
                if not freq[victim]:
                    break
                freq[victim] = 0
                lists.push_tail(_MAIN, victim)
        self._forget(victim)
        return victim

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        """Yield free blocks in the order `pop_victim` takes them while nothing else
        changes: unhashed; S's oldest while S holds its share; M's blocks without the
        frequency bit, then those with it (they get one more round); the rest of S.
        """
        lists, freq = self._lists, self._freq
        len_s = lists.length(_SMALL)
        num_first = len_s
        if lists.length(_MAIN):
            num_first = min(len_s, max(0, len_s - self._small_target + 1))
        small = lists.iter_list(_SMALL)
        order = chain(
            lists.iter_list(_REUSABLE),
            islice(small, num_first),
            (b for b in lists.iter_list(_MAIN) if not freq[b]),
            (b for b in lists.iter_list(_MAIN) if freq[b]),
            small,
        )
        return lists.after_cursor(order, cursor)

    def clear_and_fill(self, block_ids: range) -> None:
        """Queue exactly `block_ids` as unhashed blocks, reused in that order; keep the ghost."""
        self._lists.clear()
        for block_id in block_ids:
            self._keys[block_id] = None
            self._freq[block_id] = 0
            self._dest[block_id] = _SMALL
            self._lists.push_tail(_REUSABLE, block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent lists, state or ghost."""
        self._lists.check_invariants()
        assert len(self._ghost) <= 2 * self._ghost_capacity, "ghost FIFO too large"
        assert all(f in (0, 1) for f in self._freq), "frequency bit out of range"
        for block_id in self._lists.iter_list(_REUSABLE):
            assert self._keys[block_id] is None, f"unhashed block {block_id} has a key"
        for list_id in (_SMALL, _MAIN):
            for block_id in self._lists.iter_list(list_id):
                assert self._keys[block_id] is not None, f"cached block {block_id} has no key"
                assert self._dest[block_id] == list_id, (
                    f"block {block_id} queued in list {list_id} is bound for {self._dest[block_id]}"
                )
                assert list_id == _MAIN or not self._freq[block_id], (
                    f"block {block_id} in the small FIFO has its frequency bit set"
                )
