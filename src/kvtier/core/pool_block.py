"""A read-only view of one block of a `BlockPool` (what `BlockPool.block` returns)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.core.keys import Key

if TYPE_CHECKING:
    from kvtier.core.pool_queries import PoolQueries

NULL_BLOCK_ID = 0  # never handed out; a null slot in a block table


class PoolBlock:
    """A read-only view of one block of a `BlockPool` (satisfies `GpuBlockView`)."""

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: PoolQueries, block_id: int) -> None:
        self._pool = pool
        self.block_id = block_id

    @property
    def is_null(self) -> bool:
        """Return True for the null block."""
        return self.block_id == NULL_BLOCK_ID

    @property
    def ref_count(self) -> int:
        """Return the block's reference count."""
        return self._pool.ref_count(self.block_id)

    @property
    def key(self) -> Key | None:
        """Return the primary key, or None when the block is not cached."""
        return self._pool.key(self.block_id)

    @property
    def num_tokens(self) -> int:
        """Return the number of tokens the primary key covers (0 when not cached)."""
        return self._pool.num_tokens(self.block_id)

    @property
    def secondary_keys(self) -> Sequence[Key]:
        """Return the keys held besides the primary one."""
        return self._pool.secondary_keys(self.block_id)
