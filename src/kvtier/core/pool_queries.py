"""The read-only queries of a `BlockPool`: counts, per-block state, key lookups.

`PoolQueries` is a mixin of `BlockPool` and never changes the pool; `block_pool` and
`pool_key_removal` keep the operations that do. The methods read the pool's arrays and
dicts directly (no call per query beyond the method itself), so the batch getters stay as
fast as before the split.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice

from kvtier.core import pool_checks
from kvtier.core.free_queue import FreeQueue
from kvtier.core.keys import Key
from kvtier.core.pool_block import NULL_BLOCK_ID, PoolBlock
from kvtier.core.pool_checks import PoolError


class PoolQueries:
    """Read-only queries over the state a `BlockPool` owns and sets up in its `__init__`."""

    num_blocks: int
    _refs: array[int]
    _num_tokens: array[int]
    _keys: list[Key | None]
    _secondary: dict[int, list[Key]]
    _tags: dict[int, bytes]
    _index: dict[Key, int]
    _more_blocks: dict[Key, list[int]]
    _free: FreeQueue

    @property
    def num_usable_blocks(self) -> int:
        """Return the number of blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    def num_free(self) -> int:
        """Return the number of blocks with ref count 0, cached ones included."""
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        """Return True when `allocate(num_blocks)` would succeed; raise as it does for a
        count that is not an int or is negative."""
        if type(num_blocks) is not int or num_blocks < 0:  # a bool or numpy int too
            num_blocks = pool_checks.allocation_size(num_blocks)
        return num_blocks <= len(self._free)

    def block(self, block_id: int) -> PoolBlock:
        """Return a view of block `block_id`."""
        self._check_id(block_id)
        return PoolBlock(self, block_id)

    def ref_count(self, block_id: int) -> int:
        """Return the reference count of `block_id`; raise PoolError for an id out of range."""
        # The range test is inline: calling _check_id every time triples the getter's cost.
        if not 0 <= block_id < self.num_blocks:
            self._check_id(block_id)  # raises PoolError naming the id and the range
        return self._refs[block_id]

    def keys(self, block_ids: Sequence[int]) -> list[Key | None]:
        """Return each block's primary key (None when it holds none), in order.

        The ids are not checked: a min/max test of a step's batch costs more than the
        lookups themselves. A negative id reads a block counted from the end, as a list
        index does; one past the end raises IndexError.
        """
        keys = self._keys
        return [keys[block_id] for block_id in block_ids]

    def key(self, block_id: int) -> Key | None:
        """Return the primary key of `block_id`, or None; raise PoolError for an id out of range."""
        if not 0 <= block_id < self.num_blocks:
            self._check_id(block_id)  # raises
        return self._keys[block_id]

    def num_tokens(self, block_id: int) -> int:
        """Return how many tokens the primary key of `block_id` covers.

        Raises PoolError for an id out of range.
        """
        if not 0 <= block_id < self.num_blocks:
            self._check_id(block_id)  # raises
        return self._num_tokens[block_id]

    def tag(self, block_id: int, key: Key | None = None) -> bytes | None:
        """Return the token tag recorded with the block's primary key, or None; with
        `key`, None too unless `key` is that primary key (a secondary key has no tag).
        Raises PoolError for an id out of range."""
        if not 0 <= block_id < self.num_blocks:
            self._check_id(block_id)  # raises
        if key is not None and self._keys[block_id] != key:
            return None
        return self._tags.get(block_id)

    def secondary_keys(self, block_id: int) -> Sequence[Key]:
        """Return the secondary keys of `block_id` (empty when none).

        Raises PoolError for an id out of range.
        """
        if not 0 <= block_id < self.num_blocks:
            self._check_id(block_id)  # raises
        return tuple(self._secondary.get(block_id, ()))

    def token_counts(self, block_ids: Sequence[int]) -> list[int]:
        """Return how many tokens each block's primary key covers, in order.

        The ids are not checked, as in `keys`.
        """
        counts = self._num_tokens
        return [counts[block_id] for block_id in block_ids]

    def secondary_keys_of(self, block_ids: Sequence[int]) -> dict[int, Sequence[Key]]:
        """Return the secondary keys of those of `block_ids` that hold any."""
        secondary = self._secondary
        if not secondary:
            return {}
        return {b: tuple(secondary[b]) for b in block_ids if b in secondary}

    def is_cached(self, block_id: int) -> bool:
        """Return True when `block_id` holds a key; raise PoolError for an id out of range."""
        if not 0 <= block_id < self.num_blocks:
            self._check_id(block_id)  # raises
        return self._keys[block_id] is not None

    @property
    def index(self) -> Mapping[Key, int]:
        """Return the live key index (key -> a block holding it); read it, never change it.

        For hot loops: `key in pool.index` is `cached_block(key) is not None` without a call.
        """
        return self._index

    def cached_block(self, key: Key) -> int | None:
        """Return a block holding `key`, or None."""
        return self._index.get(key)

    def cached_blocks(self, key: Key) -> list[int]:
        """Return every block holding `key`."""
        first = self._index.get(key)
        if first is None:
            return []
        return [first, *self._more_blocks.get(key, ())]

    def lookup(self, keys: Iterable[Key]) -> list[int]:
        """Return the blocks of the leading run of `keys` that are cached."""
        found: list[int] = []
        index = self._index
        for key in keys:
            block_id = index.get(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def iter_free_after(self, cursor: int | None) -> Iterator[int]:
        """Yield free blocks in eviction order after `cursor`; from the head if None or busy."""
        if cursor is not None:
            self._check_id(cursor)
            if cursor == NULL_BLOCK_ID or self._refs[cursor] != 0:
                cursor = None
        return self._free.iter_after(cursor)

    def free_after(self, cursor: int | None, limit: int) -> tuple[list[int], list[Key | None]]:
        """Return the first `limit` blocks `iter_free_after(cursor)` yields, and their keys."""
        block_ids = list(islice(self.iter_free_after(cursor), limit))
        return block_ids, self.keys(block_ids)

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not hasattr(block_id, "__index__"):
            raise PoolError(f"block id {block_id!r} is not an int")
        if not 0 <= block_id < self.num_blocks:
            raise PoolError(f"block id {block_id} out of range [0, {self.num_blocks})")
