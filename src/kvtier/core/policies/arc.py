"""`arc`: Adaptive Replacement Cache (Megiddo & Modha, FAST '03) over a block pool.

Free cached blocks sit in T1 (seen once since stored) or T2 (hit at least once, or
re-stored soon after being evicted). Evicted keys are remembered in ghost lists B1 / B2;
a store whose key is in B1 means T1 was too small, so the target size `p` of T1 grows;
a key found in B2 shrinks it. The victim comes from T1 while T1 holds more than `p`
free blocks, else from T2.

Pool adaptation: pinned blocks are out of the queue, so list sizes count free blocks
only; a touched block rejoins at T2's most-recently-used end when freed. The ghost
directory is trimmed to as many keys as the pool has usable blocks at each store, after
the store's ghost look-up (the pool evicts before it knows the new key). Unlike the
paper, B1 is not held to c - |T1|: after a scan B1 keeps the scanned keys, and one that
comes back raises `p` (the paper's bound measured lower on Mooncake: docs/policies.md).

Cost: O(1) per operation. Memory per block: 9 bytes of links, 1 byte of destination and
an 8-byte key reference; per ghost key about 100 bytes (the key and its dict slot).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain, islice

from kvtier.core.free_queue import OneByOne, check_num_blocks
from kvtier.core.keys import Key
from kvtier.core.policies.block_lists import BlockLists

_REUSABLE, _T1, _T2 = 0, 1, 2


class ARCPolicy(OneByOne):
    """ARC eviction order for a pool of `num_blocks` blocks (block 0, the null block, unused)."""

    name = "arc"

    def __init__(self, num_blocks: int) -> None:
        check_num_blocks(num_blocks, type(self).__name__)
        self.num_blocks = num_blocks  # the pool's size it is made for
        self._lists = BlockLists(num_blocks, 3)
        self._capacity = max(1, num_blocks - 1)
        self._keys: list[Key | None] = [None] * num_blocks
        self._dest = array("b", [_T1]) * num_blocks
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self.target_t1 = 0.0  # ARC's p

    def __len__(self) -> int:
        return self._lists.total()

    def note_key(self, block_id: int, key: Key) -> None:
        """Send the block to T2 if its key is a ghost (and adapt `p`), else to T1."""
        if self._keys[block_id] == key:
            return  # already noted (idempotent: the pool and its owner may both call it)
        self._keys[block_id] = key
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.target_t1 = min(self._capacity, self.target_t1 + max(len(b2) / len(b1), 1.0))
            del b1[key]
            self._dest[block_id] = _T2
        elif key in b2:
            self.target_t1 = max(0.0, self.target_t1 - max(len(b1) / len(b2), 1.0))
            del b2[key]
            self._dest[block_id] = _T2
        else:
            self._dest[block_id] = _T1
        self._trim_ghosts(self._capacity)

    def push_reusable(self, block_id: int) -> None:
        """Queue an unhashed block: reused before any cached block."""
        self._keys[block_id] = None
        self._lists.push_head(_REUSABLE, block_id)

    def push_cached(self, block_id: int) -> None:
        """Queue a cached block at the MRU end of its list."""
        self._lists.push_tail(self._dest[block_id], block_id)

    def remove(self, block_id: int) -> None:
        """Take a touched block out; a cached one counts as a hit (→ T2 when freed)."""
        if self._lists.unlink(block_id) != _REUSABLE:
            self._dest[block_id] = _T2

    def discard(self, block_id: int) -> None:
        """Take a free block out whose keys the pool dropped: no hit, no ghost."""
        self._lists.unlink(block_id)
        self._keys[block_id] = None
        self._dest[block_id] = _T1

    def take(self, block_id: int) -> None:
        """Take a free block out without a hit: freed again, it rejoins its list."""
        self._lists.unlink(block_id)

    def evict(self, block_id: int) -> None:
        """Take a free cached block out as ARC evicts: its key becomes a ghost of its list."""
        where = self._lists.unlink(block_id)
        if where != _REUSABLE:
            self._retire(block_id, self._b1 if where == _T1 else self._b2)

    def evict_taken(self, block_id: int) -> None:
        """Record the eviction of a taken block: its key becomes a ghost of its list."""
        self._retire(block_id, self._b1 if self._dest[block_id] == _T1 else self._b2)

    def pop_victim(self) -> int:
        """Return an unhashed block if any, else ARC's replacement victim."""
        lists = self._lists
        if lists.length(_REUSABLE):
            return lists.pop_head(_REUSABLE)
        len_t1 = lists.length(_T1)
        if len_t1 and (len_t1 > self.target_t1 or not lists.length(_T2)):
            victim, ghost = lists.pop_head(_T1), self._b1
        elif lists.length(_T2):
            victim, ghost = lists.pop_head(_T2), self._b2
        else:
            raise IndexError("free queue is empty")
        self._retire(victim, ghost)
        return victim

    def _retire(self, victim: int, ghost: OrderedDict[Key, None]) -> None:
        """Forget an evicted block's state; remember its key in `ghost`."""
        key = self._keys[victim]
        self._keys[victim] = None
        self._dest[victim] = _T1
        if key is not None:
            # A key several blocks held may already be a ghost of the other list.
            (self._b2 if ghost is self._b1 else self._b1).pop(key, None)
            ghost[key] = None
            ghost.move_to_end(key)
            # Trim to the directory size at the next store, after its ghost look-up: the
            # pool evicts before the new key is known, and ARC looks the key up first.
            self._trim_ghosts(2 * self._capacity)

    def _trim_ghosts(self, limit: int) -> None:
        b1, b2 = self._b1, self._b2
        while len(b1) + len(b2) > limit:
            if b1 and (len(b1) + self._lists.length(_T1) > self._capacity or not b2):
                b1.popitem(last=False)
            else:
                b2.popitem(last=False)

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        """Yield free blocks in the order `pop_victim` takes them while no key is stored
        (`p` moves only then): unhashed; T1's oldest until T1 is down to `p`; T2; the
        rest of T1 (SPEC §4: the cascade's write-back demotes exactly the next victims).
        """
        lists = self._lists
        len_t1 = lists.length(_T1)
        num_first = len_t1
        if lists.length(_T2):
            p = self.target_t1  # T1 gives the k-th victim while len_t1 - k > p, exactly
            num_first = min(len_t1, max(0, math.ceil(len_t1 - p)))
            while num_first > 0 and not len_t1 - (num_first - 1) > p:
                num_first -= 1  # float rounding in the estimate
            while num_first < len_t1 and len_t1 - num_first > p:
                num_first += 1
        t1 = lists.iter_list(_T1)
        order = chain(lists.iter_list(_REUSABLE), islice(t1, num_first), lists.iter_list(_T2), t1)
        return lists.after_cursor(order, cursor)

    def clear_and_fill(self, block_ids: range) -> None:
        """Queue exactly `block_ids` as unhashed blocks, reused in that order; keep ghosts."""
        self._lists.clear()
        for block_id in block_ids:
            self._keys[block_id] = None
            self._lists.push_tail(_REUSABLE, block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent lists, ghosts or target."""
        self._lists.check_invariants()
        assert 0.0 <= self.target_t1 <= self._capacity, f"p={self.target_t1} out of range"
        assert len(self._b1) + len(self._b2) <= 2 * self._capacity, "ghost directory too large"
        assert not (self._b1.keys() & self._b2.keys()), "a key is in both ghost lists"
        for block_id in self._lists.iter_list(_REUSABLE):
            assert self._keys[block_id] is None, f"unhashed block {block_id} has a key"
        for list_id in (_T1, _T2):
            for block_id in self._lists.iter_list(list_id):
                assert self._keys[block_id] is not None, f"cached block {block_id} has no key"
                assert self._dest[block_id] == list_id, (
                    f"block {block_id} queued in list {list_id} is bound for {self._dest[block_id]}"
                )
