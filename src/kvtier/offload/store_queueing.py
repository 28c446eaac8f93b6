"""Queueing one accepted GPU block's store: its checks, pin, tier slot and batch entry.

`StoreQueueing`, a mixin of `StoreSelector`, holds what every selection path (eager,
lazy, hand-offs, partial tails) does with a candidate block once chosen, and the release
of stores that will register nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, key_group_id
from kvtier.core.kv_groups import KVLayout
from kvtier.core.policies import AdmissionPolicy
from kvtier.core.token_tags import Tag
from kvtier.offload.disk_slots import SetAsideSlots
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.lazy_walk import LazyWalk
from kvtier.offload.protocols import GpuPoolView
from kvtier.offload.request_tags import RequestTags
from kvtier.offload.stats import StoreOutcome
from kvtier.offload.store_batch import StoreBatch


class StoreQueueing:
    """The store queueing of a `StoreSelector`, over the fields that dataclass declares."""

    __slots__ = ()

    layout: KVLayout
    gpu_pool: GpuPoolView
    tier_pool: BlockPool
    queued: StoreBatch
    in_flight_keys: set[Key]
    lazy: LazyWalk
    admission: AdmissionPolicy
    tags: RequestTags | None
    set_aside: SetAsideSlots | None
    replaced: DroppedSlots | None

    def try_select(
        self,
        gpu_block_id: int,
        tail_key: Key | None = None,
        tail_num_tokens: int = 0,
        stored: BlockStored | None = None,
        tag: tuple[Key, Tag] | None = None,
    ) -> StoreOutcome:
        """Pin `gpu_block_id`, allocate a tier slot and queue the copy, unless skipped.

        `tag` is (the key the tag was computed for, the tag): recorded when that key is
        the block's.
        """
        if gpu_block_id == NULL_BLOCK_ID:
            return StoreOutcome.NULL
        key = tail_key if tail_key is not None else self.gpu_pool.key(gpu_block_id)
        if key is None:
            return StoreOutcome.UNHASHED
        if key in self.in_flight_keys:
            return StoreOutcome.IN_FLIGHT
        own_tag = tag[1] if tag is not None and tag[0] == key else None
        if self.tier_pool.cached_block(key) is not None and not (
            own_tag is not None and self.replace_untagged(key)
        ):
            return StoreOutcome.ALREADY_CACHED
        if not self.admission.admit(key):
            return StoreOutcome.NOT_ADMITTED
        if self.tags is not None and own_tag is None:
            return StoreOutcome.NO_TAG  # never served with the check on
        if not self.tier_room(1):
            return StoreOutcome.TIER_FULL
        self.gpu_pool.touch([gpu_block_id])
        (tier_block_id,) = self.tier_pool.allocate(1)
        self.in_flight_keys.add(key)
        self.queued.add(gpu_block_id, tier_block_id, key, tail_num_tokens, stored, own_tag)
        if not tail_num_tokens:
            self.note_counts(len(self.queued) - 1)
        return StoreOutcome.STORED

    def note_counts(self, first: int) -> None:
        """Record the token counts of the stores queued from `first` on whose keys cover
        part of their GPU blocks only (`StoreBatch.counts`): a block that loses its keys
        before the copy completes registers the key selected, with that count."""
        if not self.layout.keys_inside_blocks:
            return
        queued, groups = self.queued, self.layout.groups
        counts = self.gpu_pool.token_counts(queued.gpu_block_ids[first:])
        for index, count in enumerate(counts, first):
            if 0 < count < groups[key_group_id(queued.keys[index])].block_size:
                queued.counts[index] = count

    def replace_untagged(self, key: Key) -> bool:
        """Drop the tier's copies of `key` when none carries a token tag, so that a
        tagged store of `key` replaces them; return True when it did.

        Only with the token check on a disk-only tier (`replaced` set): a copy without a
        tag (restored from a run without the check) is never served, and kept, it made
        every store of its key a skip. A block holding `key` as its primary key loses
        its keys and its slot goes to `replaced` (a restart must not restore it either);
        one holding it as a secondary key keeps its primary key. Nothing is dropped when
        a copy is tagged (it is served, or a hash collision's: kept) or pinned.
        """
        if self.replaced is None:
            return False
        pool = self.tier_pool
        blocks = pool.cached_blocks(key)
        primary = [block for block in blocks if pool.key(block) == key]
        if any(pool.tag(block) is not None or pool.ref_count(block) for block in primary):
            return False
        for block in blocks:
            if block in primary:
                pool.discard_keys(block)
            else:
                pool.discard_secondary_key(block, key)
        self.replaced.add(primary)
        return True

    def tier_room(self, needed: int) -> int:
        """Return the free tier slots; held disk slots come back first when fewer than
        `needed` are free (they cost capacity only while the disk has other room)."""
        if self.set_aside is not None:
            self.set_aside.make_room(needed)
        return self.tier_pool.num_free()

    def drop_queued(self, gpu_block_ids: Iterable[int]) -> None:
        """Release the queued (not yet issued) stores of `gpu_block_ids`: their compute
        turned out unconfirmed (`unconfirmed_finish`) after they were selected."""
        wanted = set(gpu_block_ids)
        if not self.queued or wanted.isdisjoint(self.queued.gpu_block_ids):
            return
        self.release(self.queued.take(wanted))

    def release(self, stores: StoreBatch, forget_keys: bool = True, failed: bool = False) -> None:
        """Drop the pins (and in-flight keys) of stores that will register nothing.

        `failed` (a worker failed the stores): a disk tier holds their slots as suspects.
        """
        self.gpu_pool.free(stores.gpu_block_ids[::-1])  # tail first, as on completion
        if self.lazy.copying:
            self.lazy.copying.difference_update(stores.gpu_block_ids)
        if failed and self.set_aside is not None:  # freed, a bad slot would be reused first
            self.set_aside.note_failed(stores.tier_block_ids)
        else:
            self.tier_pool.free(stores.tier_block_ids[::-1])
        if forget_keys:
            self.in_flight_keys.difference_update(stores.keys)
