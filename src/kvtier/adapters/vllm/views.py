"""vLLM's request and GPU block pool, seen through kvtier's engine protocols.

Keys need no conversion: vLLM's `BlockHashWithGroupId` (block hash + group id in 4
big-endian bytes) is exactly a kvtier key (`kvtier.core.keys`), so keys cross the
boundary as they are.

No vLLM import: the wrappers only read attributes, so this module imports without vLLM.
Thread affinity: the scheduler thread of the engine core, like the objects they wrap.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from operator import attrgetter
from typing import Any

from kvtier.core.keys import BlockHash, Key, key_group_id
from kvtier.core.kv_groups import tokens_inside_block
from kvtier.offload.protocols import LoRAInfo

_BLOCK_ID = attrgetter("block_id")


def reads_hash_slots(blocks: Sequence[Any]) -> bool:
    """Return True when `blocks` are vLLM `KVCacheBlock`s whose `block_hash` and
    `block_hash_num_tokens` properties return the slots `_block_hash` and
    `_block_hash_num_tokens` (vLLM 0.33).

    The batched reads of a step's blocks then read the slots: a property is a Python
    call per block (~3x the read). Other blocks (tests' stand-ins) go through the names.
    """
    if not blocks:
        return False
    attrs = type(blocks[0]).__dict__
    return all(
        isinstance(attrs.get(name), property)
        and type(attrs.get(f"_{name}")).__name__ == "member_descriptor"
        for name in ("block_hash", "block_hash_num_tokens")
    )


def tokens_in_block(block: Any, block_sizes: Sequence[int]) -> int:
    """Return how many of `block`'s own tokens its primary key covers; 0 when not recorded.

    vLLM records the prefix a key covers, counted from the request's first token (block 3
    of 16-token blocks: 64; a partial entry ending 5 tokens into it: 53); kvtier counts
    the tokens inside the block (16; 5). `block_sizes`: the block size of each KV group.
    """
    end = block.block_hash_num_tokens
    if not end:
        return 0
    size = block_sizes[key_group_id(block.block_hash)] if len(block_sizes) > 1 else block_sizes[0]
    return tokens_inside_block(int(end), size)


class VllmRequestView:
    """A vLLM `Request` as a kvtier `RequestView`; reads through, copies nothing but the
    id, which never changes.

    Read for every running request every step: `request_id` is a plain attribute and the
    counts are returned as vLLM holds them (ints), without a conversion call.
    """

    __slots__ = ("request", "request_id")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.request_id: str = str(request.request_id)

    @property
    def num_tokens(self) -> int:
        """Return prompt plus output tokens so far."""
        return int(self.request.num_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        """Return the prompt length."""
        return int(self.request.num_prompt_tokens)

    @property
    def num_computed_tokens(self) -> int:
        """Return the tokens the engine counts as computed (may include a pending load)."""
        num_tokens: int = self.request.num_computed_tokens
        return num_tokens

    @property
    def num_output_placeholders(self) -> int:
        """Return the tokens scheduled but not yet confirmed (async scheduling)."""
        num_tokens: int = self.request.num_output_placeholders
        return num_tokens

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Return vLLM's chained hashes at `hash_block_size` (grown in place by vLLM)."""
        hashes: Sequence[BlockHash] = self.request.block_hashes
        return hashes

    @property
    def token_ids(self) -> Sequence[int]:
        """Return prompt plus output token ids (a read-only view)."""
        token_ids: Sequence[int] = self.request.all_token_ids
        return token_ids

    @property
    def lora(self) -> LoRAInfo | None:
        """Return the LoRA adapter identity, or None."""
        lora_request = self.request.lora_request
        if lora_request is None:
            return None
        return LoRAInfo(int(lora_request.lora_int_id), str(lora_request.lora_name))

    @property
    def skip_prefix_cache(self) -> bool:
        """Return True when the request must not read any prefix cache."""
        return bool(self.request.skip_reading_prefix_cache)

    @property
    def session_id(self) -> str | None:
        """Return the session vLLM's request carries (its GPU events carry it too)."""
        session_id: str | None = getattr(self.request, "session_id", None)
        return session_id

    def block_extra_keys(self, start: int, end: int) -> tuple[object, ...]:
        """Return vLLM's extra keys of the block of tokens [start, end), as its hash has them.

        Imports vLLM on first use (stored-block events with payloads only).
        """
        request = self.request
        if not (
            request.mm_features
            or request.lora_request
            or request.prompt_embeds is not None
            or (start == 0 and request.cache_salt)
        ):
            return ()  # what vLLM's function returns then, without its per-block calls
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return tuple(keys) if keys else ()

    def blocks_extra_keys(self, block_size: int, count: int) -> list[tuple[object, ...]]:
        """Return `block_extra_keys` of the first `count` blocks of `block_size` tokens.

        Without multimodal items or prompt embeddings (vLLM's only keys that depend on a
        block's tokens), every block but the first has the second's keys (a LoRA's or
        none): those two are computed and the second's repeated. Else block by block,
        vLLM's multimodal index carried from one block to the next, as its hasher does.
        """
        if count <= 0:
            return []
        request = self.request
        if not request.mm_features and request.prompt_embeds is None:
            first = self.block_extra_keys(0, block_size)
            if count == 1:
                return [first]
            rest = self.block_extra_keys(block_size, 2 * block_size)
            return [first, *([rest] * (count - 1))]
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        out: list[tuple[object, ...]] = []
        mm_index = 0
        last: tuple[object, ...] = ()
        for start in range(0, count * block_size, block_size):
            keys, mm_index = generate_block_hash_extra_keys(
                request, start, start + block_size, mm_index
            )
            block = tuple(keys) if keys else ()
            out.append(last := last if block == last else block)  # equal keys shared
        return out


class VllmGpuBlockView:
    """One block of vLLM's GPU pool as a kvtier `GpuBlockView`."""

    __slots__ = ("_block", "_block_sizes", "_pool")

    def __init__(self, pool: Any, block: Any, block_sizes: Sequence[int]) -> None:
        self._pool = pool
        self._block = block
        self._block_sizes = block_sizes

    @property
    def block_id(self) -> int:
        """Return the block id."""
        return int(self._block.block_id)

    @property
    def is_null(self) -> bool:
        """Return True for the null block."""
        return bool(self._block.is_null)

    @property
    def ref_count(self) -> int:
        """Return the reference count (not maintained by vLLM for the null block)."""
        return int(self._block.ref_cnt)

    @property
    def key(self) -> Key | None:
        """Return the primary key, or None when the block is not cached."""
        key: Key | None = self._block.block_hash
        return key

    @property
    def num_tokens(self) -> int:
        """Return the block's tokens the primary key covers; 0 when vLLM recorded no count."""
        return tokens_in_block(self._block, self._block_sizes)

    @property
    def secondary_keys(self) -> Sequence[Key]:
        """Return the block's other keys (e.g. a partial tail), unordered."""
        extra = self._pool.cached_block_hashes_by_block.get(self._block.block_id)
        return list(extra) if extra else []


class VllmGpuPoolView:
    """vLLM's GPU `BlockPool` as a kvtier `GpuPoolView` (block ids in, block ids out).

    `block_sizes`: the block size of each KV group, to count a key's tokens inside its
    block (`tokens_in_block`).
    """

    def __init__(self, pool: Any, block_sizes: Sequence[int]) -> None:
        if not block_sizes or min(block_sizes) <= 0:
            raise ValueError(f"block_sizes must be positive, one per KV group; got {block_sizes}")
        self.pool = pool
        self._blocks = pool.blocks
        self._block_sizes = tuple(block_sizes)
        self._slots = reads_hash_slots(pool.blocks)

    def block(self, block_id: int) -> VllmGpuBlockView:
        """Return a view of block `block_id`."""
        return VllmGpuBlockView(self.pool, self._blocks[block_id], self._block_sizes)

    def key(self, block_id: int) -> Key | None:
        """Return the primary key of block `block_id`, or None when it is not cached."""
        key: Key | None = self._blocks[block_id].block_hash
        return key

    def keys(self, block_ids: Sequence[int]) -> list[Key | None]:
        """Return each block's primary key (None when not cached), in order."""
        blocks = self._blocks
        if self._slots:
            return [blocks[block_id]._block_hash for block_id in block_ids]
        return [blocks[block_id].block_hash for block_id in block_ids]

    def num_tokens(self, block_id: int) -> int:
        """Return the block's tokens the primary key covers; 0 when vLLM recorded no count."""
        return tokens_in_block(self._blocks[block_id], self._block_sizes)

    def secondary_keys(self, block_id: int) -> Sequence[Key]:
        """Return the block's other keys (e.g. a partial tail), unordered."""
        extra = self.pool.cached_block_hashes_by_block.get(block_id)
        return list(extra) if extra else []

    def token_counts(self, block_ids: Sequence[int]) -> list[int]:
        """Return `num_tokens` of each block, in order."""
        blocks, sizes = self._blocks, self._block_sizes
        if len(sizes) > 1:
            return [tokens_in_block(blocks[block_id], sizes) for block_id in block_ids]
        size = sizes[0]  # one group: `tokens_inside_block` inlined (a step's stores)
        if self._slots:
            return [
                (end - 1) % size + 1 if (end := blocks[block_id]._block_hash_num_tokens) else 0
                for block_id in block_ids
            ]
        return [
            (end - 1) % size + 1 if (end := blocks[block_id].block_hash_num_tokens) else 0
            for block_id in block_ids
        ]

    def secondary_keys_of(self, block_ids: Sequence[int]) -> dict[int, Sequence[Key]]:
        """Return the other keys of those of `block_ids` that hold any."""
        extra = self.pool.cached_block_hashes_by_block
        if not extra:
            return {}
        return {b: list(extra[b]) for b in block_ids if extra.get(b)}

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each block; a free block leaves vLLM's free queue."""
        blocks = self._blocks
        self.pool.touch([blocks[block_id] for block_id in block_ids])

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, in order (vLLM's eviction order rules)."""
        blocks = self._blocks
        self.pool.free_blocks([blocks[block_id] for block_id in block_ids])

    def discard_keys_of(self, block_ids: Sequence[int]) -> None:
        """Drop the blocks' hashes from vLLM's prefix cache (`BlockPool.evict_blocks`, the
        call vLLM makes for blocks a failed load left invalid; referenced blocks stay
        with their requests, and vLLM emits their `BlockRemoved` events)."""
        if block_ids:
            self.pool.evict_blocks(set(block_ids))

    def cached_block(self, key: Key) -> int | None:
        """Return a block id holding `key` in vLLM's prefix cache, or None."""
        block = self.pool.cached_block_hash_to_block.get_one_block(key)
        return None if block is None else int(block.block_id)

    def cached_blocks(self, key: Key) -> list[int]:
        """Return every block id holding `key` in vLLM's prefix cache.

        vLLM's map has no public call for all of them: it holds one block, or a dict of
        the blocks by id when the hash was cached twice (`BlockHashToBlockMap.insert`).
        """
        blocks = self.pool.cached_block_hash_to_block._cache.get(key)
        if blocks is None:
            return []
        if isinstance(blocks, dict):
            return [int(block_id) for block_id in blocks]
        return [int(blocks.block_id)]

    def iter_free_after(self, cursor: int | None) -> Iterator[int]:
        """Return an iterator of free block ids in eviction order after `cursor`.

        From the head when `cursor` is None or no longer free (it was reused or touched).
        """
        return map(_BLOCK_ID, self._free_blocks_after(cursor))

    def free_after(self, cursor: int | None, limit: int) -> tuple[list[int], list[Key | None]]:
        """Return the first `limit` free block ids `iter_free_after(cursor)` yields, and
        their primary keys, read from the same blocks in one pass: lazy mode's walk visits
        up to twice a step's worth of blocks every step."""
        blocks = list(islice(self._free_blocks_after(cursor), limit))
        if self._slots:
            return [block.block_id for block in blocks], [block._block_hash for block in blocks]
        return [block.block_id for block in blocks], [block.block_hash for block in blocks]

    def _free_blocks_after(self, cursor: int | None) -> Iterator[Any]:
        """Return the free blocks after `cursor`'s block while it is free, else all of them."""
        start = None
        if cursor is not None:
            block = self._blocks[cursor]
            if not block.is_null and block.ref_cnt == 0:
                start = block
        return self.pool.free_block_queue.iter_blocks_after(start)
