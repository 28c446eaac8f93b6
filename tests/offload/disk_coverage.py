"""What a write-through cascade owes the disk, for the stateful test's write-through runs.

Write-through demotes every block the CPU tier registers. So once the disk works and
the drain has run the retries out, every (CPU block, primary key) pair the CPU tier
holds has a disk copy of its key (with its token tag, when the check is on), unless one
of the reasons the cascade may leave it without one applies:

- its demotion failed `MAX_DEMOTION_ATTEMPTS` times (given up; counted as failed
  demotions, and as a lost block if the CPU tier evicts it);
- the disk lost a copy of its key since the pair appeared (evicted to make room, its
  keys discarded after a failed load or replaced by the token check, a reset): the
  cascade writes a key once per CPU registration, it does not watch the disk.

`DiskCoverage` hooks the cascade and the disk pool to learn those, and `missing`
returns the pairs left without a disk copy for no such reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.offload.cascade import Cascade, MoveItem

Pair = tuple[int, Key]


class DiskCoverage:
    """Watch a write-through cascade; `observe` after every step, `missing` after a drain."""

    def __init__(self, cascade: Cascade) -> None:
        self.cascade = cascade
        self.clock = 0  # `observe` calls
        self.since: dict[Pair, int] = {}  # CPU pairs held at the last observe → first seen
        self.left_disk: dict[Key, int] = {}  # key → the clock when a disk copy last went
        self.given_up: set[Pair] = set()
        self._hook_disk(cascade.disk_pool)
        note_failed = cascade._note_failed_write_through

        def noting(items: Sequence[MoveItem], retried: dict[Pair, int]) -> None:
            note_failed(items, retried)
            for item in items:
                pair = (item.cpu_block_id, item.key)
                held = cascade.cpu_pool.key(item.cpu_block_id) == item.key
                if held and pair not in cascade.retry:
                    self.given_up.add(pair)

        cascade._note_failed_write_through = noting  # type: ignore[method-assign]

    def _hook_disk(self, pool: BlockPool) -> None:
        """Note every disk key that goes, whichever way it goes."""
        assert pool.on_evict is None, "the disk pool's eviction hook is taken"

        def lost(keys: Sequence[Key | None]) -> None:
            for key in keys:
                if key is not None:
                    self.left_disk[key] = self.clock

        def keys_of(block_id: int) -> list[Key | None]:
            return [pool.key(block_id), *pool.secondary_keys(block_id)]

        drop_keys, discard_secondary, reset = (
            pool._drop_keys,
            pool.discard_secondary_key,
            pool.reset,
        )

        def dropping(block_id: int) -> None:
            lost(keys_of(block_id))
            drop_keys(block_id)

        def discarding(block_id: int, key: Key) -> None:
            lost([key])
            discard_secondary(block_id, key)

        def resetting() -> bool:
            held = [k for b in range(pool.num_blocks) for k in keys_of(b)]
            cleared = reset()
            if cleared:
                lost(held)
            return cleared

        pool.on_evict = lambda block_id, _key: lost(keys_of(block_id))
        pool._drop_keys = dropping  # type: ignore[method-assign]
        pool.discard_secondary_key = discarding  # type: ignore[method-assign]
        pool.reset = resetting  # type: ignore[method-assign]

    def cpu_pairs(self) -> list[Pair]:
        pool = self.cascade.cpu_pool
        return [(b, k) for b in range(pool.num_blocks) if (k := pool.key(b)) is not None]

    def observe(self) -> None:
        """Note the CPU pairs held now (after a step), and since when."""
        self.clock += 1
        self.since = {pair: self.since.get(pair, self.clock) for pair in self.cpu_pairs()}
        self.given_up &= set(self.since)  # a pair stored afresh is owed a demotion again

    def missing(self) -> list[Pair]:
        """Return the CPU pairs held with no disk copy and no reason to lack one."""
        self.observe()
        cascade, missing = self.cascade, []
        for pair in self.cpu_pairs():
            block_id, key = pair
            if cascade._disk_copy(block_id, key) is not None or pair in self.given_up:
                continue
            # A copy that went during the step the pair appeared in counts (clock - 1).
            if self.left_disk.get(key, -2) >= self.since[pair] - 1:
                continue
            missing.append(pair)
        return missing
