"""Offline policies that read the future: Belady's rule (the reference line) and an
oracle LFU (what perfect popularity knowledge alone is worth).

`belady` evicts the free block whose key is used again farthest in the future
(never-again blocks first); `oracle-lfu` evicts the free block whose key has the fewest
uses left in the trace. Admission, for both: a block is stored only if its key is used
again and ranks better than the block it would evict (the classic bypass). Both read the
future from a `FutureOracle` built from the whole trace; the replay tells them which
request is current (`on_request`). A heap gives O(log n) per operation, fine offline.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvtier.core.free_queue import OneByOne
from kvtier.core.keys import Key

NEVER = 1 << 62
BELADY = "belady"
ORACLE_LFU = "oracle-lfu"
OFFLINE_POLICIES = (BELADY, ORACLE_LFU)


class FutureOracle:
    """For the current request: where each of its keys is referenced next, and how often
    it is referenced after this request.

    Positions count block references over the whole trace, so ties between requests
    are broken by position within the request (deeper blocks later). With `reach_from`
    (request i's references reach the tier from position `reach_from[i]` on: a tier in
    front serves the ones before) only references that reach the tier count as uses;
    every reference, reaching or not, is told the next one that does.
    `gpu_capacity_tokens` names the GPU tier `reach_from` accounts for (0: none), so a
    replay can refuse an oracle built for another one.
    """

    def __init__(
        self,
        keys_per_request: Sequence[Sequence[Key]],
        reach_from: Sequence[int] | None = None,
        gpu_capacity_tokens: int = 0,
    ) -> None:
        self.gpu_capacity_tokens = gpu_capacity_tokens
        if reach_from is not None and len(reach_from) != len(keys_per_request):
            raise ValueError(
                f"reach_from has {len(reach_from)} entries for {len(keys_per_request)} requests"
            )
        self._keys = keys_per_request
        next_ref: list[array[int]] = []
        uses_left: list[array[int]] = []
        later: dict[Key, int] = {}
        count: dict[Key, int] = {}
        position = sum(len(keys) for keys in keys_per_request)
        for i in range(len(keys_per_request) - 1, -1, -1):
            keys = keys_per_request[i]
            reach = 0 if reach_from is None else reach_from[i]
            position -= len(keys)
            row = array("q", [NEVER]) * len(keys)
            left = array("q", [0]) * len(keys)
            for j in range(len(keys) - 1, -1, -1):
                key = keys[j]
                row[j] = later.get(key, NEVER)
                left[j] = count.get(key, 0)
                if j >= reach:
                    later[key] = position + j
                    count[key] = left[j] + 1
            next_ref.append(row)
            uses_left.append(left)
        next_ref.reverse()
        uses_left.reverse()
        self._next_ref = next_ref
        self._uses_left = uses_left
        self._current: dict[Key, tuple[int, int]] = {}
        self.index = -1

    def on_request(self, index: int) -> None:
        """Make request `index` the current one."""
        if index != self.index:
            self.index = index
            self._current = dict(
                zip(
                    self._keys[index],
                    zip(self._next_ref[index], self._uses_left[index], strict=True),
                    strict=True,
                )
            )

    def current_keys(self) -> Iterable[Key]:
        """Return the keys the current request references."""
        return self._current.keys()

    def next_use(self, key: Key) -> int:
        """Return where `key` (of the current request) is referenced next, or `NEVER`."""
        found = self._current.get(key)
        return NEVER if found is None else found[0]

    def uses_left(self, key: Key) -> int:
        """Return how many later references `key` (of the current request) has."""
        found = self._current.get(key)
        return 0 if found is None else found[1]

    def belady_rank(self, key: Key) -> int:
        """Return Belady's eviction rank (higher goes first): the next use."""
        return self.next_use(key)

    def oracle_lfu_rank(self, key: Key) -> int:
        """Return the oracle LFU's eviction rank (higher goes first): fewer uses left."""
        return -self.uses_left(key)


Rank = Callable[[Key], int]


class OraclePolicy(OneByOne):
    """Evict the free block of highest rank, unhashed first. Ties: the block freed or
    ranked again longest ago (a rank read anew restamps the block).

    `rank` reads the future of a key of the current request: `FutureOracle.belady_rank`
    or `FutureOracle.oracle_lfu_rank`. A block is ranked when it is freed, and ranked
    again whenever a request references its key without touching it (a tier in front
    served it, or the prefix lookup stopped before it): a rank read at an earlier
    reference would point into the past.
    """

    def __init__(self, num_blocks: int, oracle: FutureOracle, rank: Rank, name: str) -> None:
        self.name = name
        self._oracle = oracle
        self._rank = rank
        self._keys: list[Key | None] = [None] * num_blocks
        self._block_of: dict[Key, int] = {}
        self._stamp = array("q", [0]) * num_blocks  # > 0 while queued as cached
        self._next_stamp = 1
        self._heap: list[tuple[int, int, int]] = []  # (-next use, stamp, block)
        self._reusable: list[int] = []  # a stack: the last pushed is reused first
        self._is_reusable = bytearray(num_blocks)
        self._num_cached = 0

    def __len__(self) -> int:
        return self._num_cached + len(self._reusable)

    def on_request(self, index: int) -> None:
        """Forward the current request to the oracle; rank its queued blocks again."""
        self._oracle.on_request(index)
        for key in self._oracle.current_keys():
            block_id = self._block_of.get(key)
            if block_id is not None and self._stamp[block_id]:
                self._num_cached -= 1  # the old heap entry goes stale with its stamp
                self.push_cached(block_id)

    def note_key(self, block_id: int, key: Key) -> None:
        """Remember the block's key."""
        self._forget_key(block_id)
        self._keys[block_id] = key
        self._block_of[key] = block_id

    def _forget_key(self, block_id: int) -> None:
        key = self._keys[block_id]
        if key is not None and self._block_of.get(key) == block_id:
            del self._block_of[key]
        self._keys[block_id] = None

    def push_reusable(self, block_id: int) -> None:
        """Queue an unhashed block."""
        self._forget_key(block_id)
        self._reusable.append(block_id)
        self._is_reusable[block_id] = 1

    def push_cached(self, block_id: int) -> None:
        """Queue a cached block under its key's rank (the block was used just now)."""
        key = self._keys[block_id]
        rank = NEVER if key is None else self._rank(key)
        stamp = self._next_stamp
        self._next_stamp += 1
        self._stamp[block_id] = stamp
        heapq.heappush(self._heap, (-rank, stamp, block_id))
        self._num_cached += 1

    def remove(self, block_id: int) -> None:
        """Take a block out (lazily for the heap)."""
        if self._is_reusable[block_id]:
            self._reusable.remove(block_id)  # rare: unhashed blocks are allocated, not touched
            self._is_reusable[block_id] = 0
            return
        if not self._stamp[block_id]:
            raise KeyError(f"block {block_id} is not queued")
        self._stamp[block_id] = 0
        self._num_cached -= 1

    def take(self, block_id: int) -> None:
        """Take a free block out (freed again, it is ranked again)."""
        self.remove(block_id)

    def evict(self, block_id: int) -> None:
        """Take a free cached block out and forget its key, as `pop_victim` does."""
        self.remove(block_id)
        self._forget_key(block_id)

    def evict_taken(self, block_id: int) -> None:
        """Forget a taken block's key, as `pop_victim` does."""
        self._forget_key(block_id)

    def pop_victim(self) -> int:
        """Return an unhashed block if any, else the highest-ranked one."""
        if self._reusable:
            block_id = self._reusable.pop()
            self._is_reusable[block_id] = 0
            return block_id
        heap = self._heap
        while heap:
            _, stamp, block_id = heapq.heappop(heap)
            if self._stamp[block_id] == stamp:
                self._stamp[block_id] = 0
                self._num_cached -= 1
                self._forget_key(block_id)
                return block_id
        raise IndexError("free queue is empty")

    def victim_rank(self) -> int | None:
        """Return the rank of the block `pop_victim` would evict; None when no cached block
        would be evicted (none is cached, or an unhashed block is reused instead)."""
        if self._reusable:
            return None
        heap = self._heap
        while heap and self._stamp[heap[0][2]] != heap[0][1]:
            heapq.heappop(heap)
        return -heap[0][0] if heap else None

    def rank(self, key: Key) -> int:
        """Return the eviction rank of `key` now."""
        return self._rank(key)

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        """Yield free blocks in eviction order (sorts the heap: for checks only)."""
        order = list(reversed(self._reusable))
        order += [b for _, s, b in sorted(self._heap) if self._stamp[b] == s]
        start = 0 if cursor is None else order.index(cursor) + 1
        yield from order[start:]

    def clear_and_fill(self, block_ids: range) -> None:
        """Queue exactly `block_ids` as unhashed blocks, reused in that order."""
        self._heap.clear()
        self._block_of.clear()
        self._num_cached = 0
        for b in range(len(self._stamp)):
            self._stamp[b] = 0
            self._is_reusable[b] = 0
        self._reusable = list(reversed(block_ids))
        for block_id in block_ids:
            self._is_reusable[block_id] = 1
            self._keys[block_id] = None

    def check_invariants(self) -> None:
        """Raise AssertionError when the live heap entries and the count disagree."""
        live = [b for _, s, b in self._heap if self._stamp[b] == s]
        assert len(live) == len(set(live)) == self._num_cached, "heap and count disagree"
        assert all(self._is_reusable[b] for b in self._reusable), "reusable flags"
        assert sum(self._is_reusable) == len(self._reusable), "reusable count"
        for key, block_id in self._block_of.items():
            assert self._keys[block_id] == key, f"block {block_id} lost key {key!r}"


class OracleAdmission:
    """Store a block only if its key is used again and ranks below the would-be victim.

    The second condition is the bypass of the classic optimum: storing a block that would
    itself be the next victim only evicts a block needed sooner.
    """

    def __init__(self, oracle: FutureOracle, eviction: OraclePolicy) -> None:
        self.name = eviction.name
        self._oracle = oracle
        self._eviction = eviction

    def on_request(self, index: int) -> None:
        """Forward the current request to the oracle."""
        self._oracle.on_request(index)

    def admit(self, key: Key) -> bool:
        """Return True when `key` is used again and ranks below the block it would evict."""
        if self._oracle.next_use(key) == NEVER:
            return False
        victim = self._eviction.victim_rank()
        return victim is None or self._eviction.rank(key) < victim

    def check_invariants(self) -> None:
        """Nothing to check: stateless besides the oracle."""


def make_oracle_policies(
    name: str, num_blocks: int, oracle: FutureOracle
) -> tuple[OraclePolicy, OracleAdmission]:
    """Return the eviction and admission policy of `belady` or `oracle-lfu`."""
    ranks = {BELADY: oracle.belady_rank, ORACLE_LFU: oracle.oracle_lfu_rank}
    if name not in ranks:
        raise ValueError(f"unknown offline policy {name!r}; choose one of {', '.join(ranks)}")
    eviction = OraclePolicy(num_blocks, oracle, ranks[name], name)
    return eviction, OracleAdmission(oracle, eviction)
