"""`duel`: LRU, or LFU-DA while a miniature simulation shows that LFU-DA hits more.

The tier keeps two orders over its free cached blocks: LRU (least recently freed first)
and `lfuda`'s (core/policies/lfuda.py). Which one picks the victim is decided online by
**set dueling** with miniature simulations (Qureshi et al., ISCA '07; Waldspurger et al.,
ATC '17): two shadow caches of at most `max_shadow_blocks` keys, one LRU and one LFU-DA,
replay the tier's access stream, sampled by key hash at rate `capacity / shadow size`
(no sampling up to 4,096 blocks). Accesses are what a tier sees: every store
(`note_key`) and every hit (`remove` of a cached free block). Every `shadow size` sampled
accesses the two shadows' hit counts (halved after each decision, so they weigh recent
behaviour) are compared: the tier switches to the LFU-DA order when the LFU-DA shadow
leads by more than `z` standard deviations (`z * sqrt(hits_lru + hits_lfu)`, the
Poisson noise of the counts) and back to LRU when LRU leads by as much; otherwise it
keeps its order. It starts in LRU order, so it is exactly LRU until frequency pays off
in the shadows, and it falls back to LRU when frequency stops paying.

Parameters (chosen on the replay sweep of benchmarks/bench_replay.py):
- F = `max_frequency` of the LFU-DA order and shadow, 2 (as `lfuda`);
- `z`, 0.5: the lead (in standard deviations) the other shadow needs before the order
  switches, against flapping on noise. On 9 replayed workloads (Mooncake, 8 chat
  variants) z = 0.5 fell below LRU at one point of 99, by 0.00006; z = 0 and 0.1 by up
  to 0.0006 (chat, 5 M), z = 0.25 by 0.0003, z = 1-2 by up to 0.001;
- `max_shadow_blocks`, 4,096: the shadows' size (memory and noise of the estimate).

Cost: O(1) per operation (a sampled access costs one store or hit in each shadow).
Memory per tier block: `lfuda`'s ~60 bytes + 9 bytes of LRU links + 1 byte (`take`'s
note); plus two shadow block pools of at most 4,096 blocks each (~1.5 MB with their
keys), whatever the tier size.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.core.block_pool import BlockPool
from kvtier.core.free_queue import FreeQueue, LRUFreeQueue, OneByOne, check_num_blocks
from kvtier.core.keys import Key
from kvtier.core.policies.block_lists import NOT_LISTED, BlockLists
from kvtier.core.policies.lfuda import DEFAULT_MAX_FREQUENCY, LFUDAPolicy
from kvtier.core.policies.params import check_finite_at_least, check_int_at_least

DEFAULT_Z = 0.5
DEFAULT_MAX_SHADOW_BLOCKS = 4096
_SAMPLE_MULTIPLIER = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class ShadowCache:
    """A key-only cache of `num_blocks` blocks under `free_queue`'s order; counts its hits."""

    __slots__ = ("_pool", "_queue", "hits")

    def __init__(self, num_blocks: int, free_queue: FreeQueue) -> None:
        self._queue = free_queue
        self._pool = BlockPool(num_blocks + 1, free_queue=free_queue)
        self.hits = 0.0

    def access(self, key: Key) -> None:
        """Hit `key` (refresh it) or store it, evicting per the order."""
        pool = self._pool
        block_id = pool.cached_block(key)
        if block_id is not None:
            pool.touch([block_id])
            pool.free([block_id])
            self.hits += 1
            return
        (block_id,) = pool.allocate(1)
        pool.insert_key(key, block_id, 1)
        self._queue.note_key(block_id, key)  # idempotent if the pool already did
        pool.free([block_id])

    def check_invariants(self) -> None:
        """Raise AssertionError when the shadow pool is inconsistent."""
        self._pool.check_invariants()


class DuelingPolicy(OneByOne):
    """LRU or LFU-DA order for a pool of `num_blocks` blocks, chosen by set dueling."""

    name = "duel"

    def __init__(
        self,
        num_blocks: int,
        max_frequency: int = DEFAULT_MAX_FREQUENCY,
        z: float = DEFAULT_Z,
        max_shadow_blocks: int = DEFAULT_MAX_SHADOW_BLOCKS,
    ) -> None:
        check_num_blocks(num_blocks, type(self).__name__)
        self.num_blocks = num_blocks  # the pool's size it is made for
        check_finite_at_least(z, "z", 0)
        check_int_at_least(max_shadow_blocks, "max_shadow_blocks", 1)
        capacity = max(1, num_blocks - 1)
        self._lfu = LFUDAPolicy(num_blocks, max_frequency)
        self._ages = bytearray(num_blocks)  # taken blocks: would evicting them age LFU-DA
        self._lru = BlockLists(num_blocks, 1)  # cached free blocks, least recently freed first
        self._rate = -(-capacity // max_shadow_blocks)  # sample 1 key in `rate`
        shadow_blocks = max(1, capacity // self._rate)
        self._shadow_lru = ShadowCache(shadow_blocks, LRUFreeQueue(shadow_blocks + 1))
        self._shadow_lfu = ShadowCache(shadow_blocks, LFUDAPolicy(shadow_blocks + 1, max_frequency))
        self._window = shadow_blocks
        self._sampled = 0
        self._z = z
        self.lfu_order = False  # False: LRU picks the victims

    def __len__(self) -> int:
        return len(self._lfu)

    def _observe(self, key: Key) -> None:
        if self._rate > 1:
            x = int.from_bytes(key[:8], "little")
            if (((x * _SAMPLE_MULTIPLIER) & _MASK64) >> 40) % self._rate:
                return
        lru, lfu = self._shadow_lru, self._shadow_lfu
        lru.access(key)
        lfu.access(key)
        self._sampled += 1
        if self._sampled >= self._window:
            self._sampled = 0
            bar = self._z * (lru.hits + lfu.hits) ** 0.5
            if lfu.hits - lru.hits > bar:
                self.lfu_order = True
            elif lru.hits - lfu.hits > bar:
                self.lfu_order = False
            lru.hits /= 2
            lfu.hits /= 2

    def note_key(self, block_id: int, key: Key) -> None:
        """Count the store as an access (shadows and the LFU-DA sketch)."""
        if self._lfu.noted_key(block_id) == key:
            return  # already noted (idempotent: the pool and its owner may both call it)
        self._observe(key)
        self._lfu.note_key(block_id, key)

    def push_reusable(self, block_id: int) -> None:
        """Queue an unhashed block: reused before any cached block."""
        self._lfu.push_reusable(block_id)

    def push_cached(self, block_id: int) -> None:
        """Queue a cached block at the MRU end of both orders."""
        self._lfu.push_cached(block_id)
        self._lru.push_tail(0, block_id)

    def remove(self, block_id: int) -> None:
        """Take a touched block out; a cached one counts as an access."""
        if self._lru.where(block_id) != NOT_LISTED:
            self._lru.unlink(block_id)
            key = self._lfu.noted_key(block_id)
            if key is not None:
                self._observe(key)
        self._lfu.remove(block_id)

    def discard(self, block_id: int) -> None:
        """Take a free block out whose keys the pool dropped, counting no access."""
        if self._lru.where(block_id) != NOT_LISTED:
            self._lru.unlink(block_id)
        self._lfu.discard(block_id)

    def take(self, block_id: int) -> None:
        """Take a free block out without an access (the shadows see nothing).

        Notes whether evicting it now would age LFU-DA (`evict`'s rule), for
        `evict_taken`: a pin is taken on the next victims, to evict them.
        """
        self._ages[block_id] = self._would_age(block_id)
        if self._lru.where(block_id) != NOT_LISTED:
            self._lru.unlink(block_id)
        self._lfu.take(block_id)

    def _would_age(self, block_id: int) -> bool:
        # bool(): a numpy id compares to a numpy bool, which `_ages` (a bytearray) refuses.
        return self.lfu_order or bool(self._lfu.peek_cached_victim() == block_id)

    def evict(self, block_id: int) -> None:
        """Take a free cached block out as `pop_victim` evicts: LFU-DA ages when its
        order picks the victims, or when the block is its cached victim too (unhashed
        blocks queued ahead do not count: `pop_victim` reaches this block after them)."""
        ages = self._would_age(block_id)
        if self._lru.where(block_id) != NOT_LISTED:
            self._lru.unlink(block_id)
        if ages:
            self._lfu.evict(block_id)
        else:
            self._lfu.discard(block_id)

    def evict_taken(self, block_id: int) -> None:
        """Record the eviction of a taken block as `evict` would have when it was taken."""
        if self._ages[block_id]:
            self._lfu.evict_taken(block_id)
        else:
            self._lfu.forget_taken(block_id)
        self._ages[block_id] = 0

    def pop_victim(self) -> int:
        """Return an unhashed block if any, else the victim of the current order."""
        victim = self._lfu.peek_victim()
        if self.lfu_order or self._lfu.is_reusable(victim) or victim == self._lru.head(0):
            self._lfu.pop_victim()  # ages LFU-DA (`L` rises)
        else:
            lru_victim = self._lru.head(0)
            assert lru_victim is not None, "a cached free block is in no order"
            victim = lru_victim
            self._lfu.discard(victim)
        if self._lru.where(victim) != NOT_LISTED:
            self._lru.unlink(victim)
        return victim

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        """Yield free blocks in eviction order of the current order, after `cursor`."""
        if self.lfu_order:
            yield from self._lfu.iter_after(cursor)
            return
        if cursor is not None and self._lru.where(cursor) != NOT_LISTED:
            yield from self._lru.iter_list(0, cursor)
            return
        if cursor is not None and not self._lfu.is_reusable(cursor):
            raise KeyError(f"block {cursor} is not queued")
        yield from self._lfu.iter_reusable_after(cursor)
        yield from self._lru.iter_list(0)

    def clear_and_fill(self, block_ids: range) -> None:
        """Queue exactly `block_ids` as unhashed blocks; keep the shadows and the sketch."""
        self._lru.clear()
        self._lfu.clear_and_fill(block_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError when the orders disagree on the set of free blocks."""
        self._lfu.check_invariants()
        self._lru.check_invariants()
        lru_blocks = set(self._lru.iter_list(0))
        lfu_blocks = set(self._lfu.iter_after(None))
        unhashed = set(self._lfu.iter_reusable_after(None))
        assert lru_blocks == lfu_blocks - unhashed, "LRU and LFU-DA orders hold different blocks"
        assert not lru_blocks & unhashed, "an unhashed block is in the LRU order"
        for shadow in (self._shadow_lru, self._shadow_lfu):
            shadow.check_invariants()
        assert 0 <= self._sampled < self._window, "sample counter out of range"
