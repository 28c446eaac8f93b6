"""KV cache groups and the block geometry they imply (SPEC §1, §5).

A group is a set of layers sharing one attention kind and block size. The scheduler
block is the LCM of the group block sizes (external hits start and end on it); the hash
block is their GCD unless configured (it must divide every group's block size).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TypeGuard


def _is_int(value: object) -> TypeGuard[int]:
    """Return True for an int that is not a bool (bool subclasses int)."""
    return isinstance(value, int) and not isinstance(value, bool)


class GroupKind(enum.Enum):
    """What a group keeps, and so which of its blocks a hit needs."""

    FULL_ATTENTION = "full_attention"  # every block
    SLIDING_WINDOW = "sliding_window"  # the blocks of the last window
    STATE = "state"  # only the latest state block; not positionally stable
    SCRATCH = "scratch"  # never stored or loaded


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV group: its kind, block size in tokens and bytes per block."""

    kind: GroupKind
    block_size: int
    bytes_per_block: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        try:
            # A kind given by its value ("full_attention") must not pass as another kind.
            object.__setattr__(self, "kind", GroupKind(self.kind))
        except ValueError:
            choices = ", ".join(k.value for k in GroupKind)
            raise ValueError(
                f"unknown group kind {self.kind!r}; expected one of {choices}"
            ) from None
        if not _is_int(self.block_size) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not _is_int(self.bytes_per_block) or self.bytes_per_block < 0:
            raise ValueError(
                f"bytes_per_block must be a non-negative int, got {self.bytes_per_block!r}"
            )
        if self.kind is GroupKind.SLIDING_WINDOW:
            if not _is_int(self.sliding_window) or self.sliding_window <= 0:
                raise ValueError(
                    f"a sliding-window group needs a positive sliding_window, "
                    f"got {self.sliding_window!r}"
                )
        elif self.sliding_window is not None:
            raise ValueError(f"sliding_window is only for sliding-window groups ({self.kind})")

    @property
    def is_cacheable(self) -> bool:
        """Return True when the group's blocks are stored and loaded."""
        return self.kind is not GroupKind.SCRATCH

    @property
    def is_positional(self) -> bool:
        """Return True when block j of a request always holds tokens of block j."""
        return self.kind in (GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW)

    @property
    def num_window_blocks(self) -> int:
        """Return how many trailing blocks a sliding-window hit needs before its end."""
        assert self.sliding_window is not None
        return math.ceil((self.sliding_window - 1) / self.block_size)


@dataclass(frozen=True)
class KVLayout:
    """All KV groups of a model, with the derived scheduler and hash block sizes."""

    groups: tuple[KVGroupSpec, ...]
    configured_hash_block_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.groups, tuple | list):
            raise TypeError(f"groups must be a tuple of KVGroupSpec, got {self.groups!r}")
        object.__setattr__(self, "groups", tuple(self.groups))  # frozen and hashable
        if not self.groups:
            raise ValueError("a KV layout needs at least one group")
        for group_id, group in enumerate(self.groups):
            if not isinstance(group, KVGroupSpec):
                raise TypeError(f"group {group_id} is {group!r}, not a KVGroupSpec")
        hbs = self.configured_hash_block_size
        if hbs is not None:
            if not _is_int(hbs) or hbs <= 0:
                raise ValueError(f"hash_block_size must be a positive int, got {hbs!r}")
            for group_id, group in enumerate(self.groups):
                if group.block_size % hbs:
                    raise ValueError(
                        f"hash_block_size {hbs} does not divide the block size "
                        f"{group.block_size} of group {group_id}"
                    )

    @staticmethod
    def single(block_size: int, bytes_per_block: int) -> KVLayout:
        """Return a layout of one full-attention group."""
        return KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, block_size, bytes_per_block),))

    @cached_property
    def scheduler_block_size(self) -> int:
        """Return the LCM of the group block sizes."""
        return math.lcm(*(g.block_size for g in self.groups))

    @cached_property
    def hash_block_size(self) -> int:
        """Return the configured hash block size, else the GCD of the group block sizes."""
        if self.configured_hash_block_size is not None:
            return self.configured_hash_block_size
        return math.gcd(*(g.block_size for g in self.groups))

    @cached_property
    def bytes_per_block(self) -> int:
        """Return the bytes one block id spans across every group (one tier slot)."""
        return sum(g.bytes_per_block for g in self.groups)

    @cached_property
    def cacheable_group_ids(self) -> tuple[int, ...]:
        """Return the ids of groups whose blocks are stored and loaded."""
        return tuple(i for i, g in enumerate(self.groups) if g.is_cacheable)

    @cached_property
    def positional_groups(self) -> tuple[tuple[int, int], ...]:
        """Return (group id, block size) of every cacheable, positionally stable group."""
        return tuple(
            (i, g.block_size)
            for i, g in enumerate(self.groups)
            if g.is_cacheable and g.is_positional
        )

    @cached_property
    def lone_full_group(self) -> int | None:
        """Return the id of the only cacheable group when it is full attention, else None
        (`find_longest_hit`'s fast path: most models' layouts)."""
        cacheable = self.cacheable_group_ids
        if len(cacheable) == 1 and self.groups[cacheable[0]].kind is GroupKind.FULL_ATTENTION:
            return cacheable[0]
        return None

    @cached_property
    def coarse_state_groups(self) -> dict[int, int]:
        """Return {group id: block size} of the cacheable state groups whose block spans
        several hash blocks.

        Hits end on whole blocks of such a group (`supports_fine_grained_hits` is off), so
        a block of it keyed where a hash block ends inside it (an engine's partial tail)
        is never served: it is not stored.
        """
        hbs = self.hash_block_size
        return {
            i: g.block_size
            for i, g in enumerate(self.groups)
            if g.kind is GroupKind.STATE and g.block_size > hbs
        }

    @cached_property
    def keys_inside_blocks(self) -> bool:
        """Return True when a cacheable group's block spans several hash blocks: a key
        of it may cover part of its block only (an engine's partial entry)."""
        return any(self.blocks_per_hash(i) > 1 for i in self.cacheable_group_ids)

    def blocks_per_hash(self, group_id: int) -> int:
        """Return how many hash blocks one block of `group_id` spans."""
        return self.groups[group_id].block_size // self.hash_block_size

    @cached_property
    def supports_fine_grained_hits(self) -> bool:
        """Return True when hits may end inside a full-attention block.

        That needs a full-attention group whose block spans several hash blocks while
        every other cacheable group matches at hash-block granularity.
        """
        hbs = self.hash_block_size
        cacheable = [self.groups[i] for i in self.cacheable_group_ids]
        has_coarse_full = any(
            g.kind is GroupKind.FULL_ATTENTION and g.block_size > hbs for g in cacheable
        )
        others_fine = all(
            g.block_size == hbs for g in cacheable if g.kind is not GroupKind.FULL_ATTENTION
        )
        return has_coarse_full and others_fine


def tokens_inside_block(prefix_tokens: int, block_size: int) -> int:
    """Return the tokens inside the block whose key covers a request's first
    `prefix_tokens` tokens (vLLM's count): 64 with 16-token blocks is 16, 53 is 5."""
    return (prefix_tokens - 1) % block_size + 1
