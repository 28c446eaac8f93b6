"""Several intrusive doubly linked lists over block ids, in two flat arrays.

The building block of the eviction policies: every block is in at most one list; push at
either end, unlink from the middle and pop the head are O(1), and no Python object exists
per block. Node `num_blocks + i` is the sentinel of list i (`_next[s]` is the head,
`_prev[s]` the tail). Memory: 9 bytes per block (two int32 links and one int8 list id).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

NOT_LISTED = -1


class BlockLists:
    """`num_lists` FIFO/LRU lists over block ids `0..num_blocks-1`."""

    __slots__ = ("_base", "_lens", "_next", "_prev", "_where")

    def __init__(self, num_blocks: int, num_lists: int) -> None:
        if not 1 <= num_lists <= 127:
            raise ValueError(f"num_lists must be in [1, 127], got {num_lists}")
        self._base = num_blocks
        total = num_blocks + num_lists
        self._next = array("i", range(total))
        self._prev = array("i", range(total))
        self._where = array("b", [NOT_LISTED]) * num_blocks
        self._lens = [0] * num_lists

    def clear(self) -> None:
        """Empty every list."""
        for i in range(len(self._lens)):
            s = self._base + i
            self._next[s] = s
            self._prev[s] = s
            self._lens[i] = 0
        for b in range(self._base):
            self._where[b] = NOT_LISTED

    def where(self, block_id: int) -> int:
        """Return the list holding `block_id`, or `NOT_LISTED`."""
        return self._where[block_id]

    def length(self, list_id: int) -> int:
        """Return the number of blocks in list `list_id`."""
        return self._lens[list_id]

    def total(self) -> int:
        """Return the number of blocks in all lists."""
        return sum(self._lens)

    def push_tail(self, list_id: int, block_id: int) -> None:
        """Append `block_id` (not listed) at the tail of `list_id`."""
        s = self._base + list_id
        tail = self._prev[s]
        self._next[tail] = block_id
        self._prev[block_id] = tail
        self._next[block_id] = s
        self._prev[s] = block_id
        self._where[block_id] = list_id
        self._lens[list_id] += 1

    def push_head(self, list_id: int, block_id: int) -> None:
        """Insert `block_id` (not listed) at the head of `list_id`."""
        s = self._base + list_id
        head = self._next[s]
        self._prev[head] = block_id
        self._next[block_id] = head
        self._prev[block_id] = s
        self._next[s] = block_id
        self._where[block_id] = list_id
        self._lens[list_id] += 1

    def unlink(self, block_id: int) -> int:
        """Remove `block_id` from its list and return that list's id."""
        list_id = self._where[block_id]
        if list_id == NOT_LISTED:
            raise KeyError(f"block {block_id} is in no list")
        prv = self._prev[block_id]
        nxt = self._next[block_id]
        self._next[prv] = nxt
        self._prev[nxt] = prv
        self._where[block_id] = NOT_LISTED
        self._lens[list_id] -= 1
        return list_id

    def head(self, list_id: int) -> int | None:
        """Return the head of `list_id` without removing it, or None when empty."""
        if self._lens[list_id] == 0:
            return None
        return self._next[self._base + list_id]

    def pop_head(self, list_id: int) -> int:
        """Unlink and return the head of `list_id` (which must not be empty)."""
        if self._lens[list_id] == 0:
            raise IndexError(f"list {list_id} is empty")
        block_id = self._next[self._base + list_id]
        self.unlink(block_id)
        return block_id

    def iter_list(self, list_id: int, after: int | None = None) -> Iterator[int]:
        """Yield `list_id` from head to tail, starting after `after` (a block in it) if given."""
        s = self._base + list_id
        node = self._next[s if after is None else after]
        while node != s:
            yield node
            node = self._next[node]

    def iter_lists_after(self, order: Sequence[int], cursor: int | None) -> Iterator[int]:
        """Yield the lists of `order` one after another, starting after block `cursor`.

        `cursor` must be queued in one of the lists of `order` (KeyError otherwise).
        """
        start = 0
        after = None
        if cursor is not None:
            where = self.where(cursor)
            if where == NOT_LISTED or where not in order:
                raise KeyError(f"block {cursor} is not queued")
            start, after = list(order).index(where), cursor
        for list_id in order[start:]:
            yield from self.iter_list(list_id, after)
            after = None

    def after_cursor(self, order: Iterator[int], cursor: int | None) -> Iterator[int]:
        """Return `order` (free blocks, each once) from just after block `cursor` on.

        For a policy whose eviction order interleaves its lists; O(position of `cursor`).
        `cursor` must be queued in one of the lists (KeyError otherwise).
        """
        if cursor is None:
            return order
        if self.where(cursor) == NOT_LISTED:
            raise KeyError(f"block {cursor} is not queued")
        for block_id in order:
            if block_id == cursor:
                break
        return order

    def check_invariants(self) -> None:
        """Raise AssertionError when links, lengths and list ids disagree."""
        seen = 0
        for list_id, length in enumerate(self._lens):
            s = self._base + list_id
            count = 0
            prev = s
            node = self._next[s]
            while node != s:
                assert 0 <= node < self._base, f"list {list_id}: bad node {node}"
                assert self._prev[node] == prev, f"list {list_id}: broken back link at {node}"
                assert self._where[node] == list_id, f"block {node} mislabelled"
                count += 1
                assert count <= self._base, f"list {list_id} has a cycle"
                prev, node = node, self._next[node]
            assert self._prev[s] == prev, f"list {list_id}: tail link broken"
            assert count == length, f"list {list_id}: length {length}, linked {count}"
            seen += count
        labelled = sum(1 for w in self._where if w != NOT_LISTED)
        assert labelled == seen, "a block is labelled with a list it is not linked in"
