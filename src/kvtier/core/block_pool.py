"""The block pool: ref-counted blocks, a key index and an eviction order (SPEC §4).

One pool serves as the GPU-tier pool of an engine and as the index of every lower tier.
Per-block state lives in arrays and parallel lists (no Python object per block), so a
cached block costs about 150 bytes even at 10 M blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence

from kvtier.core import pool_checks
from kvtier.core.events import AllCleared, BlockRemoved, BlockStored, KVEvent
from kvtier.core.free_queue import FreeQueue, LRUFreeQueue
from kvtier.core.keys import Key, key_block_hash, key_group_id
from kvtier.core.pool_block import NULL_BLOCK_ID as NULL_BLOCK_ID
from kvtier.core.pool_checks import PoolError as PoolError
from kvtier.core.pool_key_removal import PoolKeyRemoval
from kvtier.core.token_tags import Tag


class BlockPool(PoolKeyRemoval):
    """Blocks `0..num_blocks-1`; block 0 is the null block and is never handed out.

    The read-only queries (`ref_count`, `keys`, `lookup`, ...) come from `PoolQueries`,
    the key-removing operations (`discard_keys`, `evict_keys`, ...) from `PoolKeyRemoval`.

    Not thread-safe: one owner (the engine's scheduler or the offload scheduler) calls it.
    """

    def __init__(
        self,
        num_blocks: int,
        free_queue: FreeQueue | None = None,
        medium: str | None = None,
        record_events: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is null), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.medium = medium
        self._record_events = record_events
        self._refs = array("i", bytes(4 * num_blocks))
        self._num_tokens = array("i", bytes(4 * num_blocks))
        self._keys: list[Key | None] = [None] * num_blocks
        self._secondary: dict[int, list[Key]] = {}
        self._tags: dict[int, Tag] = {}  # block -> the token tag of its primary key's KV
        self._index: dict[Key, int] = {}
        self._more_blocks: dict[Key, list[int]] = {}  # a key held by several blocks
        self._free: FreeQueue = free_queue if free_queue is not None else LRUFreeQueue(num_blocks)
        # A queue made for another size: too small, LRU's links take a block for their
        # sentinel; too large, a policy's targets (S3-FIFO's small FIFO) are off.
        made_for = getattr(self._free, "num_blocks", num_blocks)
        try:
            if made_for != num_blocks:
                raise IndexError
            self._free.clear_and_fill(range(1, num_blocks))
        except IndexError:
            raise ValueError(
                f"free queue {type(self._free).__name__} is made for {made_for} blocks, not "
                f"the pool's {num_blocks}; make it for num_blocks={num_blocks}"
            ) from None
        self._events: list[KVEvent] = []
        # `keep_payloads`: (block, key) -> the payload-carrying event that stored it.
        self._payloads: dict[tuple[int, Key], BlockStored] | None = None
        # Called with (block id, primary key) just before `allocate` evicts a cached block.
        self.on_evict: Callable[[int, Key], None] | None = None

    # ----------------------------------------------------------------- changes

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue with ref count 1.

        A cached block taken this way loses its keys (one `BlockRemoved` per key).
        Raises `PoolError` when fewer than `num_blocks` are free, TypeError for a non-int.
        """
        if type(num_blocks) is not int or num_blocks < 0:  # a bool or numpy int too
            num_blocks = pool_checks.allocation_size(num_blocks)
        if num_blocks > len(self._free):
            raise PoolError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        taken = self._free.pop_victims(num_blocks)
        keys = self._keys
        refs = self._refs
        on_evict = self.on_evict
        # The common eviction inline: one key, held by this block only, no events.
        simple = (
            not self._secondary
            and not self._record_events
            and not self._more_blocks
            and not self._tags
        )
        index = self._index
        num_tokens = self._num_tokens
        for block_id in taken:
            refs[block_id] = 1
            key = keys[block_id]
            if key is None:
                continue
            if on_evict is not None:
                on_evict(block_id, key)
            if simple:
                keys[block_id] = None
                num_tokens[block_id] = 0
                del index[key]
            else:
                self._drop_keys(block_id)
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a free block leaves the free queue.

        A bad id raises PoolError after the blocks before it were touched (a check pass
        first would cost as much as the work; a bad id is the caller's bug)."""
        refs = self._refs
        block_id = NULL_BLOCK_ID
        try:
            for block_id in block_ids:
                if block_id <= NULL_BLOCK_ID or block_id is True:
                    if block_id == NULL_BLOCK_ID and block_id is not False:
                        continue
                    self._check_id(block_id)  # raises: a negative id aliases another block
                if refs[block_id] == 0:
                    self._free.remove(block_id)
                refs[block_id] += 1
        except (IndexError, TypeError):
            self._check_id(block_id)  # raises PoolError naming the id
            raise

    def pin(self, block_ids: Iterable[int]) -> None:
        """`touch` for the pool owner's own use (a copy reads the blocks): no policy
        counts it as a hit. A block freed again rejoins its list in the eviction policy
        at the most recent end; `release_evicted` evicts it from where it was."""
        refs = self._refs
        for block_id in block_ids:
            self._check_id(block_id)
            if block_id == NULL_BLOCK_ID:
                continue
            if refs[block_id] == 0:
                self._free.take(block_id)
            refs[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in order.

        Blocks reaching 0 rejoin the free queue: unhashed ones at the head (reused
        first), cached ones at the tail in the given order — pass a request's blocks
        tail-first so that prefix tails are evicted before their roots. A bad id, or one
        freed more often than referenced, raises PoolError after the blocks before it
        were freed, as `touch` does.
        """
        refs = self._refs
        keys = self._keys
        queue = self._free
        cached: list[int] = []  # queued in one batch, flushed before any other push
        block_id = NULL_BLOCK_ID
        try:
            for block_id in block_ids:
                if block_id <= NULL_BLOCK_ID or block_id is True:
                    if block_id == NULL_BLOCK_ID and block_id is not False:
                        continue
                    self._check_id(block_id)  # raises: a negative id (or a bool) aliases a block
                left = refs[block_id] - 1
                if left > 0:
                    refs[block_id] = left
                elif left == 0:
                    refs[block_id] = 0
                    if keys[block_id] is not None:
                        cached.append(block_id)
                        continue
                    if cached:
                        queue.push_cached_many(cached)
                        cached = []
                    queue.push_reusable(block_id)
                else:
                    raise PoolError(f"block {block_id} freed more often than referenced")
        except (IndexError, TypeError):
            self._check_id(block_id)  # raises PoolError naming the id
            raise
        finally:
            if cached:
                queue.push_cached_many(cached)

    def insert_key(
        self,
        key: Key,
        block_id: int,
        num_tokens: int,
        stored: BlockStored | None = None,
        tag: Tag | None = None,
    ) -> None:
        """Make `block_id` hold `key`: primary if it has none, otherwise secondary.

        `num_tokens` and `tag` (the token tag of the block's KV, `token_tags`) are
        recorded for a primary key only. `stored` is the event to record
        (when events are on); a minimal one is made when it is None. Inserting a key
        the block already holds does nothing. A free block given its primary key is
        queued as most recently used. Raises PoolError for the null block or an id out of
        range, TypeError for a key that is not bytes, ValueError for a bad `num_tokens`.
        """
        self._check_id(block_id)
        if block_id == NULL_BLOCK_ID:
            raise PoolError(f"block {block_id} cannot hold a key (the null block)")
        num_tokens = pool_checks.check_key(key, num_tokens)
        block_id = int(block_id)  # a numpy id: the index hands out plain ints
        primary = self._keys[block_id]
        if primary is None:
            self._num_tokens[block_id] = num_tokens
            self._keys[block_id] = key
            if tag is not None:
                self._tags[block_id] = tag
            if self._refs[block_id] == 0:
                # Free and unhashed, it sat among blocks reused first; cached, it is MRU.
                self._free.remove(block_id)
                self._free.note_key(block_id, key)
                self._free.push_cached(block_id)
            else:
                self._free.note_key(block_id, key)
        elif primary == key or key in self._secondary.get(block_id, ()):
            return
        else:
            self._secondary.setdefault(block_id, []).append(key)
        if key in self._index:
            self._more_blocks.setdefault(key, []).append(block_id)
        else:
            self._index[key] = block_id
        if self._record_events:
            if stored is None:
                stored = BlockStored(
                    key_block_hash(key), key_group_id(key), num_tokens, medium=self.medium
                )
            self._events.append(stored)
            if self._payloads is not None and (
                stored.token_ids or stored.lora_name or stored.extra_keys is not None
            ):
                self._payloads[block_id, key] = stored

    def keep_payloads(self) -> None:
        """Keep, while a block holds a key, the payload-carrying event that stored it there
        (`payload`); events on only. A cascade's CPU tier keeps them for its demotions'
        disk events. Costs the event (its token tuple, most of it) per key kept."""
        if self._record_events and self._payloads is None:
            self._payloads = {}

    def payload(self, block_id: int, key: Key) -> BlockStored | None:
        """Return the event with a payload (tokens, a LoRA adapter or extra keys) that stored `key`
        in `block_id`, while the block holds it (`keep_payloads`); None if there was none
        or none is kept."""
        return None if self._payloads is None else self._payloads.get((block_id, key))

    def insert_keys(
        self,
        keys: Sequence[Key],
        block_ids: Sequence[int],
        num_tokens: Sequence[int],
        tags: dict[int, Tag] | None = None,
    ) -> None:
        """`insert_key` each (key, block, num_tokens) in order, without events' payloads.

        `tags` maps an index of the lists to the tag of that block's KV (absent: none).
        The hot path of registering a step's stores: a key new to the pool going to a
        block without one is inserted inline; anything else goes through `insert_key`.
        A bad entry raises, as `insert_key` does, after the entries before it were
        inserted.
        """
        if len(keys) != len(block_ids) or len(keys) != len(num_tokens):
            raise ValueError(
                f"insert_keys needs equal lengths, got {len(keys)} keys, {len(block_ids)}"
                f" blocks and {len(num_tokens)} token counts"
            )
        block_keys = self._keys
        counts = self._num_tokens
        index = self._index
        # Recency ignores keys: the default queue's no-op is not called per block.
        note_key = (
            None if type(self._free).note_key is LRUFreeQueue.note_key else self._free.note_key
        )
        limit = self.num_blocks
        inline = not self._record_events
        refs = self._refs
        max_count = pool_checks.MAX_NUM_TOKENS
        for i, (key, block_id, count) in enumerate(zip(keys, block_ids, num_tokens, strict=True)):
            if (
                inline
                and type(block_id) is int
                and 0 < block_id < limit
                and block_keys[block_id] is None
                and refs[block_id]
                and type(count) is int
                and 0 <= count <= max_count
                and type(key) is bytes
                and key not in index
            ):
                block_keys[block_id] = key
                counts[block_id] = count
                if note_key is not None:
                    note_key(block_id, key)
                index[key] = block_id
                if tags:
                    tag = tags.get(i)
                    if tag is not None:
                        self._tags[block_id] = tag
            else:
                # The tag applies only where this entry's key becomes the primary key.
                self.insert_key(key, block_id, count, tag=tags.get(i) if tags else None)

    def reset(self) -> bool:
        """Drop every key; return False (and change nothing) while any block is referenced."""
        if len(self._free) != self.num_usable_blocks:
            return False
        removed: tuple[BlockRemoved, ...] = ()
        if self._record_events:
            removed = tuple(  # every key held, primary or secondary, once per block
                BlockRemoved(key_block_hash(key), key_group_id(key), self.medium)
                for key in self._index
                for _ in range(1 + len(self._more_blocks.get(key, ())))
            )
        self._keys = [None] * self.num_blocks
        self._num_tokens = array("i", bytes(4 * self.num_blocks))
        self._secondary.clear()
        self._tags.clear()
        self._index.clear()
        self._more_blocks.clear()
        if self._payloads:
            self._payloads.clear()
        self._free.clear_and_fill(range(1, self.num_blocks))
        if self._record_events:
            self._events.append(AllCleared(self.medium, removed))
        return True

    def take_events(self) -> list[KVEvent]:
        """Return and forget the events recorded since the last call."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError when the pool's or its free queue's bookkeeping is inconsistent."""
        pool_checks.check_pool_invariants(self)
