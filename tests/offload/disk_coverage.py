"""What a write-through cascade owes the disk, for the stateful test's write-through runs.

Write-through demotes every block the CPU tier registers (`Cascade.after_stores`). So
once the disk works and the drain has run the retries out, every (CPU block, primary
key) pair the CPU tier holds has a disk copy of its key (with its token tag, when the
check is on), unless one of the reasons the cascade may leave it without one applies:

- `MAX_DEMOTION_ATTEMPTS` demotions of the pair failed while the CPU block held it
  (given up; counted as failed demotions, and as a lost block if the CPU tier evicts it);
- a copy of its key reached the disk after the pair was handed to the cascade and a copy
  of that key left the disk after that (evicted to make room, its keys discarded after a
  failed load or replaced by the token check, a reset): the cascade writes a key once
  per CPU registration, it does not watch the disk.

`DiskCoverage` learns those by itself, not from the cascade's own state (its retry
table, its `_disk_copy`), which is what the check is about: it counts the failed
reports the scheduler hands `complete`, and hooks both pools to see every key go.
`missing` returns the pairs left without a disk copy for no such reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.offload.cascade import MAX_DEMOTION_ATTEMPTS, Cascade, MoveItem

Pair = tuple[int, Key]
# (block, its keys then, whether the block loses all of them) when a pool drops keys.
Lost = Callable[[int, Sequence[Key], bool], None]


class DiskCoverage:
    """Watch a write-through cascade from the start; `missing` after a drain."""

    def __init__(self, cascade: Cascade) -> None:
        self.cascade = cascade
        self.clock = 0  # one tick per event seen: an `after_stores`, a key arriving or leaving
        self.owed: dict[Pair, int] = {}  # held CPU pair -> its last `after_stores`
        self.covered_when_owed: set[Pair] = set()  # on disk at that moment already
        self.arrived: dict[Key, list[int]] = {}  # key -> when disk copies of it arrived
        self.left_disk: dict[Key, int] = {}  # key -> when a disk copy of it last went
        self.failures: Counter[Pair] = Counter()  # failed reports while the pair is held
        self._hook_pool(cascade.disk_pool, self._disk_lost)
        self._hook_pool(cascade.cpu_pool, self._cpu_lost)
        self._hook_cascade(cascade)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _hook_cascade(self, cascade: Cascade) -> None:
        after_stores, complete = cascade.after_stores, cascade.complete
        insert_key = cascade.disk_pool.insert_key

        def storing(cpu_block_ids: Sequence[int], loaded: Collection[int] = ()) -> None:
            # As the cascade sees them: its own demotions' disk slots may evict copies.
            now = self._tick()
            for block_id in cpu_block_ids:
                key = cascade.cpu_pool.key(block_id)
                if key is not None:
                    self.owed[(block_id, key)] = now
                    if self.on_disk(block_id, key):
                        self.covered_when_owed.add((block_id, key))
                    else:
                        self.covered_when_owed.discard((block_id, key))
            after_stores(cpu_block_ids, loaded)

        def completing(items: Sequence[MoveItem], succeeded: bool, abandoned: bool) -> None:
            complete(items, succeeded, abandoned)
            if succeeded or abandoned:
                return
            held = cascade.cpu_pool.key
            self.failures.update(
                (i.cpu_block_id, i.key) for i in items if held(i.cpu_block_id) == i.key
            )

        def inserting(key: Key, block_id: int, *args: object, **kwargs: object) -> None:
            insert_key(key, block_id, *args, **kwargs)  # type: ignore[arg-type]
            self.arrived.setdefault(key, []).append(self._tick())

        cascade.after_stores = storing  # type: ignore[method-assign]
        cascade.complete = completing  # type: ignore[method-assign]
        cascade.disk_pool.insert_key = inserting  # type: ignore[method-assign]

    def _hook_pool(self, pool: BlockPool, lost: Lost) -> None:
        """Call `lost` for every key `pool` drops, whichever way it goes."""
        on_evict, drop_keys = pool.on_evict, pool._drop_keys
        discard_secondary, reset = pool.discard_secondary_key, pool.reset

        def keys_of(block_id: int) -> list[Key]:
            primary = pool.key(block_id)
            return [] if primary is None else [primary, *pool.secondary_keys(block_id)]

        def evicting(block_id: int, key: Key) -> None:
            lost(block_id, keys_of(block_id), True)
            if on_evict is not None:
                on_evict(block_id, key)

        def dropping(block_id: int) -> None:
            lost(block_id, keys_of(block_id), True)
            drop_keys(block_id)

        def discarding(block_id: int, key: Key) -> None:
            if key in pool.secondary_keys(block_id):
                lost(block_id, [key], False)
            discard_secondary(block_id, key)

        def resetting() -> bool:
            held = [(b, keys_of(b)) for b in range(pool.num_blocks)]
            cleared = reset()
            for block_id, keys in held if cleared else ():
                if keys:
                    lost(block_id, keys, True)
            return cleared

        pool.on_evict = evicting
        pool._drop_keys = dropping  # type: ignore[method-assign]
        pool.discard_secondary_key = discarding  # type: ignore[method-assign]
        pool.reset = resetting  # type: ignore[method-assign]

    def _disk_lost(self, _block_id: int, keys: Sequence[Key], _whole: bool) -> None:
        now = self._tick()
        for key in keys:
            self.left_disk[key] = now

    def _cpu_lost(self, block_id: int, keys: Sequence[Key], whole: bool) -> None:
        if whole:  # the pair is gone: stored again, it is owed a demotion afresh
            pair = (block_id, keys[0])
            self.owed.pop(pair, None)
            self.covered_when_owed.discard(pair)
            self.failures.pop(pair, None)

    def on_disk(self, cpu_block_id: int, key: Key) -> bool:
        """Whether the disk holds what CPU block `cpu_block_id` holds under `key`: a copy
        of `key` with the CPU copy's token tag (any copy when it has none)."""
        tag, disk = self.cascade.cpu_pool.tag(cpu_block_id), self.cascade.disk_pool
        return any(tag is None or disk.tag(b, key) == tag for b in disk.cached_blocks(key))

    def cpu_pairs(self) -> list[Pair]:
        pool = self.cascade.cpu_pool
        return [(b, k) for b in range(pool.num_blocks) if (k := pool.key(b)) is not None]

    def excused(self, pair: Pair) -> bool:
        """Whether `pair` may lack a disk copy: given up, or a copy of its key reached
        the disk once it was owed and a copy of that key left the disk after that."""
        if self.failures[pair] >= MAX_DEMOTION_ATTEMPTS:
            return True
        owed = self.owed.get(pair)
        if owed is None:  # never handed to the cascade
            return False
        key = pair[1]
        arrivals = [a for a in self.arrived.get(key, ()) if a > owed]
        if pair in self.covered_when_owed:
            arrivals.append(owed)
        return bool(arrivals) and self.left_disk.get(key, -1) > min(arrivals)

    def missing(self) -> list[Pair]:
        """Return the CPU pairs held with no disk copy and no reason to lack one."""
        return [
            pair for pair in self.cpu_pairs() if not self.on_disk(*pair) and not self.excused(pair)
        ]
