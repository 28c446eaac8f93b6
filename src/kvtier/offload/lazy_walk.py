"""Lazy mode's walk over the GPU free queue (SPEC §6.6): where it resumes, and what it
remembers of the blocks it copied.

`StoreSelector.select_lazy` walks; `LazyWalk` holds the walk's state between steps, so
the selector's candidate rules stay the same for eager, lazy and finish-time stores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import Key, key_suffix
from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.offload.block_payload import request_key
from kvtier.offload.protocols import (
    GpuPoolView,
    LoRAInfo,
    RequestView,
    ScheduledRequest,
    TableUpdate,
)
from kvtier.offload.store_batch import StoreBatch


@dataclass(slots=True)
class LazyWalk:
    """The lazy walk's position and memory of copied blocks."""

    # The last visited block still in the free queue: the next walk starts after it.
    cursor: int | None = None
    # GPU block -> the key a completed store copied from it, until a request uses the
    # block again (`note_blocks_in_use`). Unpinning a stored block puts it at the free
    # queue's MRU end, where the walk meets it again; once a tier smaller than the GPU
    # cache evicted the copy, storing it again would copy blocks round in circles.
    stored: dict[int, Key] = field(default_factory=dict)
    # GPU blocks being copied that no request used since they were selected; only those
    # are remembered in `stored` once their copy completes.
    copying: set[int] = field(default_factory=set)
    # GPU blocks a walk stopped at for want of a tier slot, counted as deferred once
    # however many steps they wait: until selected, or used by a request again.
    deferred: set[int] = field(default_factory=set)
    # GPU blocks of unconfirmed compute (`hold_back`) -> their keys, also in `stored`,
    # until a request uses them again. A reset keeps them: they never held that KV.
    held: dict[int, Key] = field(default_factory=dict)
    # Events on (`record_loras`): GPU block -> the LoRA adapter of the request that last
    # used it, until a request uses it again, so that the event of a walk's store of it
    # names the adapter, as vLLM's GPU event of its key does (the key is that request's:
    # a block is keyed only while a request uses it). A reset keeps them.
    loras: dict[int, LoRAInfo] = field(default_factory=dict)
    # Events on: GPU block -> the extra keys (`RequestView.block_extra_keys`, () for
    # none) of the key a finished request left on it (`note_finished`), until a request
    # uses it again, for its store's event, as vLLM's GPU event of that key has them.
    extra_keys: dict[int, tuple[object, ...]] = field(default_factory=dict)
    record_loras: bool = False

    def clear(self) -> None:
        """Forget everything but the held-back blocks (a reset): the next walk starts
        from the head."""
        self.cursor = None
        self.stored.clear()
        self.stored.update(self.held)
        self.copying.clear()
        self.deferred.clear()

    def note_stores(self, stores: StoreBatch) -> None:
        """Remember the GPU blocks completed lazy stores copied, with their keys.

        A block a request used while its copy was in flight is not remembered: it is a
        fresh candidate again once freed, like any block a request used.
        """
        copying = self.copying
        gpu_ids = stores.gpu_block_ids
        if copying.issuperset(gpu_ids):  # the common case: no request used one meanwhile
            self.stored.update(zip(gpu_ids, stores.keys, strict=True))
        else:
            self.stored.update(
                (gpu_block_id, key)
                for gpu_block_id, key in zip(gpu_ids, stores.keys, strict=True)
                if gpu_block_id in copying
            )
        copying.difference_update(gpu_ids)

    def hold_back(self, block_ids: Iterable[int], keys: Iterable[Key | None]) -> None:
        """Remember blocks of unconfirmed compute (a failed forward) as if copied, under
        the keys the engine's pool gives them: the walk skips them until a request uses
        them again (the engine may free them with their keys, as vLLM does)."""
        held = {block_id: key for block_id, key in zip(block_ids, keys, strict=True) if key}
        self.held.update(held)
        self.stored.update(held)

    def note_allocated(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        gpu_pool: GpuPoolView,
        request: RequestView | None = None,
    ) -> None:
        """Note a request's table at its allocation (`note_blocks_in_use`; `note_lora`
        with the request), but a held-back block still under its held key stays held:
        the engine gave it as a prefix hit (a block it allocates afresh loses its key
        then), which reads the block and writes nothing (vLLM serves a same-step
        victim's unwritten blocks so)."""
        kept = None
        if self.held:
            held = self.held
            kept = {
                b: key
                for ids in block_ids_per_group
                for b in ids
                if (key := held.get(b)) is not None and gpu_pool.key(b) == key
            }
        self.note_blocks_in_use(block_ids_per_group)
        if request is not None:
            self.note_lora(request, block_ids_per_group)
        if kept:
            self.hold_back(kept, kept.values())

    def note_blocks_in_use(self, block_ids_per_group: Iterable[Sequence[int]]) -> None:
        """Note GPU blocks a request now uses.

        Freed again, they are fresh candidates, and they sit at the free queue's MRU end:
        a walk must not resume after one of them (it would skip every block queued before
        it), so a cursor among them restarts the next walk from the head.
        """
        stored_before = self.stored
        copying = self.copying
        deferred = self.deferred
        for block_ids in block_ids_per_group:
            if self.cursor is not None and self.cursor in block_ids:
                self.cursor = None
            # Only the blocks found are visited (a step's new blocks are mostly others).
            reused = stored_before.keys() & block_ids if stored_before else None
            if reused:
                for block_id in reused:
                    del stored_before[block_id]
                if self.held:
                    for block_id in self.held.keys() & block_ids:
                        del self.held[block_id]
            if copying:
                copying.difference_update(block_ids)
            if deferred:
                deferred.difference_update(block_ids)
            if self.loras:
                for block_id in self.loras.keys() & block_ids:
                    del self.loras[block_id]
            if self.extra_keys:
                for block_id in self.extra_keys.keys() & block_ids:
                    del self.extra_keys[block_id]

    def note_lora(self, request: RequestView, block_ids_per_group: Iterable[Sequence[int]]) -> None:
        """Note the adapter of a request using these GPU blocks (after
        `note_blocks_in_use`), events on and the request of an adapter only."""
        if not self.record_loras:
            return
        lora = request.lora
        if lora is not None:
            for block_ids in block_ids_per_group:
                self.loras.update(dict.fromkeys(block_ids, lora))

    def describe(self, queued: StoreBatch, start: int) -> None:
        """Give the walk's stores from index `start` of `queued` what is noted of their
        GPU blocks: the adapter and extra keys of the request that last used each, which
        vLLM's GPU event of its key names (the key is that request's)."""
        loras, extra_keys = self.loras, self.extra_keys
        for i in range(start, len(queued)):
            block_id = queued.gpu_block_ids[i]
            if (lora := loras.get(block_id)) is not None:
                queued.loras[i] = lora
            if (keys := extra_keys.get(block_id)) is not None:
                queued.extra_keys[i] = keys

    def note_finished(
        self,
        layout: KVLayout,
        request: RequestView,
        block_ids_per_group: Sequence[Sequence[int]],
        gpu_pool: GpuPoolView,
    ) -> None:
        """Note the extra keys of a finished request's blocks (events on), each under the
        key of its position in the request (a partial or other key: none noted).

        Its table is whole only now (a plan names a running request's appended blocks
        alone); a block it frees is a walk's candidate from now on.
        """
        if not self.record_loras:
            return
        noted = self.extra_keys
        hashes = request.block_hashes
        for group_id, block_ids in enumerate(block_ids_per_group):
            group = layout.groups[group_id]
            if not block_ids or not group.is_cacheable:
                continue
            ratio = layout.blocks_per_hash(group_id)
            count = min(len(block_ids), len(hashes) // ratio)  # the hashed positions
            if not count:
                continue
            # Position `pos`'s key is the request's hash `(pos + 1) * ratio - 1`.
            suffix = key_suffix(group_id)
            matched = [
                pos
                for pos, (key, block_hash) in enumerate(
                    zip(
                        gpu_pool.keys(block_ids[:count]),
                        hashes[ratio - 1 : count * ratio : ratio],
                        strict=True,
                    )
                )
                if key == block_hash + suffix
            ]
            if not matched:
                continue
            extra = request.blocks_extra_keys(group.block_size, matched[-1] + 1)
            if len(matched) == count:  # the common case: every hashed position its own
                noted.update(zip(block_ids[:count], extra, strict=True))
            else:
                for pos in matched:
                    noted[block_ids[pos]] = extra[pos]


def held_hits(
    layout: KVLayout,
    held: dict[int, Key],
    gpu_pool: GpuPoolView,
    scheduled: Iterable[ScheduledRequest],
) -> dict[int, Key]:
    """Return the held-back blocks (`LazyWalk.held`) that scheduled requests hold as
    prefix hits, still under their held keys: a new or resumed request's (its whole
    table, `TableUpdate.REPLACE`) at the positions it counts computed before the step.
    A hit reads a block and writes nothing: it stays held after the plan notes it."""
    found: dict[int, Key] = {}
    for item in scheduled:
        if item.table_update is not TableUpdate.REPLACE:
            continue  # appended blocks are new: the step writes them
        computed = item.request.num_computed_tokens
        for group_id, ids in enumerate(item.block_ids):
            for b in ids[: computed // layout.groups[group_id].block_size]:
                key = held.get(b)
                if key is not None and gpu_pool.key(b) == key:
                    found[b] = key
    return found


def lazy_target(layout: KVLayout, max_batched_tokens: int) -> int:
    """Return how many GPU free-queue blocks lazy mode visits per step (SPEC §6.6)."""
    total = 0
    for group_id in layout.cacheable_group_ids:
        group = layout.groups[group_id]
        if group.kind is GroupKind.STATE:
            total += 2
        elif group.kind is GroupKind.SLIDING_WINDOW:
            assert group.sliding_window is not None
            total += math.ceil(group.sliding_window / group.block_size) + 1
        else:
            total += math.ceil(max_batched_tokens / group.block_size)
    return 2 * total


def unwritten_blocks(
    layout: KVLayout,
    request: RequestView,
    written_tokens: int,
    max_new_tokens: int,
    gpu_pool: GpuPoolView,
) -> list[int]:
    """Return the free GPU blocks cached under the keys a preempted request's unwritten
    positions may have: those past `written_tokens`, up to `max_new_tokens` further.

    vLLM hashes a request's full blocks as it schedules them, before any forward writes
    them, and its priority policy may preempt a running request scheduled earlier in
    the same `schedule()` call: that step's blocks are freed with their keys, never
    written (the partly written block at `written_tokens` too). A block of another
    request under the same key (a prefix two requests computed) is held back too if
    free, a lost store at worst; one still in use is not.
    """
    found: list[int] = []
    end = written_tokens + max_new_tokens
    for group_id, group in enumerate(layout.groups):
        size = group.block_size
        for pos in range(written_tokens // size, end // size):
            key = request_key(layout, request, group_id, pos)
            if key is None:
                break  # not hashed, nor any later position
            found.extend(b for b in gpu_pool.cached_blocks(key) if not gpu_pool.block(b).ref_count)
    return found
