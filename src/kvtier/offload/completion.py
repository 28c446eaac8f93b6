"""Completion of issued transfers: worker reports into visible keys and finished loads.

`TransferCompletion` takes the events every worker has reported from the `TransferBook`
and releases what they pinned, tail first (SPEC §4):

    load        tier blocks + GPU dsts freed; the request's load finishes once every
                tier's part did, or fails as a whole (the suspect blocks' keys dropped:
                every block of a failed event, or only the bad blocks the workers named)
    store       keys registered, GPU src + tier slot freed; a failed or abandoned
                store registers nothing (a failed one's disk slots are held: `disk_slots`)
    demotion    handed to the `Cascade`

A persistent disk tier's manifest drops what the scheduler drops (`dropped_slots`): the
records of a failed load's suspect disk slots and of a failed store's disk slots.
"""

from __future__ import annotations

from collections import Counter

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.core.token_tags import Tag
from kvtier.offload.cascade import Cascade
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.plan import Tier, WorkerReport
from kvtier.offload.registration import Registrar
from kvtier.offload.stats import StepCounters
from kvtier.offload.store_selection import StoreSelector
from kvtier.offload.tier_index import TierIndex
from kvtier.offload.transfers import IssuedTransfer, ReportOutcome, TransferBook


class TransferCompletion:
    """Apply worker reports to the transfers they complete.

    `selector` is set once a GPU pool is bound (no transfer is issued before).
    `num_promoted` counts disk-held blocks stored into the CPU tier until its reader
    resets it. `hit_tokens` (tier value -> tokens, cumulative) gains a load's tokens once
    the whole load succeeded.
    """

    def __init__(
        self,
        tier_pool: BlockPool,
        index: TierIndex,
        registrar: Registrar,
        book: TransferBook,
        counters: StepCounters,
        cascade: Cascade | None,
        lazy: bool,
        hit_tokens: Counter[str],
        dropped: DroppedSlots | None = None,
    ) -> None:
        self._tier_pool = tier_pool
        self._index = index
        self._registrar = registrar
        self._book = book
        self._counters = counters
        self._cascade = cascade
        self._lazy = lazy  # lazy store mode: remember what completed stores copied
        self.selector: StoreSelector | None = None
        self.num_promoted = 0
        self._hit_tokens = hit_tokens
        self._dropped = dropped  # disk copies dropped: their manifest records go too

    def apply(self, report: WorkerReport) -> ReportOutcome:
        """Apply worker completions: register stored keys, release pins, finish loads."""
        finished: list[str] = []
        failed = self._book.take_unissued_failures()
        suspects: dict[str, tuple[int, ...]] = {}
        self._counters.num_failed_loads += len(failed)
        for transfer in self._book.complete(report):
            selector = self.selector
            assert selector is not None, "no GPU pool bound"
            num_copied = transfer.num_copied_blocks()
            if num_copied:  # a partly failed load counts the blocks it copied whole
                self._counters.count_transfer(transfer.transfer_type, num_copied, transfer.seconds)
            for load in transfer.loads:
                pool = self._index.pools[load.tier]
                # Tail first (SPEC §4), so a prefix's tail is evicted before its root.
                pool.free(load.tier_block_ids[::-1])
                selector.gpu_pool.free(load.gpu_block_ids[::-1])
                progress = load.progress
                progress.num_pending -= 1
                # A failed event whose workers named its bad blocks copied every other
                # block whole: only the loads reading a bad one fail.
                suspect = transfer.suspect(load.tier_block_ids)
                if not suspect:
                    self._counters.num_loaded_blocks += len(load.tier_block_ids)
                    if self._cascade is not None and load.tier is Tier.CPU:
                        self._cascade.after_cpu_loads(load.tier_block_ids)
                else:
                    progress.failed = True
                    bad = set(suspect)
                    progress.suspect_gpu_blocks += [
                        gpu
                        for tier_block, gpu in zip(
                            load.tier_block_ids, load.gpu_block_ids, strict=True
                        )
                        if tier_block in bad
                    ]
                    for block_id in suspect:  # never serve a suspect copy again
                        if self._cascade is not None and load.tier is Tier.CPU:
                            self._cascade.before_cpu_discard(block_id)
                        pool.discard_keys(block_id)
                    if load.tier is Tier.DISK and self._dropped is not None:
                        self._dropped.add(suspect)  # nor after a restart
                if progress.num_pending == 0:
                    if progress.failed:
                        failed.append(progress.failure())
                        suspects[progress.request_id] = tuple(progress.suspect_gpu_blocks)
                        self._counters.num_failed_loads += 1
                    else:
                        finished.append(progress.request_id)
                        self._hit_tokens.update(progress.tier_tokens)
            if transfer.stores:
                self._complete_stores(transfer, selector)
            if transfer.moves:
                assert self._cascade is not None
                self._cascade.complete(transfer.moves, transfer.succeeded, transfer.abandoned)
        return ReportOutcome(tuple(finished), tuple(failed), suspects)

    def _complete_stores(self, transfer: IssuedTransfer, selector: StoreSelector) -> None:
        if not transfer.succeeded or transfer.abandoned:
            if not transfer.succeeded:
                self._counters.num_failed_stores += len(transfer.stores)
                if transfer.job.dst_tier is Tier.DISK and self._dropped is not None:
                    # Another worker may have written (and recorded) the slots.
                    self._dropped.add(transfer.stores.tier_block_ids)
            # An abandoned store's keys were let go at the reset (`tier_reset`): the
            # same key may be in flight again, from a request admitted since.
            selector.release(
                transfer.stores,
                forget_keys=not transfer.abandoned,
                failed=not transfer.succeeded and not transfer.abandoned,
            )
            return
        gpu_pool = selector.gpu_pool
        stores = transfer.stores
        self._registrar.register_all(stores, gpu_pool)
        if self._lazy:
            selector.lazy.note_stores(stores)
        selector.in_flight_keys.difference_update(stores.keys)
        self._counters.num_stored_blocks += len(stores)
        if self._cascade is not None:
            disk_pool, tags = self._cascade.disk_pool, stores.tags
            if tags:  # with the token check: only a disk copy it serves counts
                held = sum(1 for i, k in enumerate(stores.keys) if _held(disk_pool, k, tags.get(i)))
            else:
                held = sum(1 for key in stores.keys if key in disk_pool.index)
            self.num_promoted += held
            self._cascade.after_stores(stores.tier_block_ids)
        # Tail first (SPEC §4): these pins may be the blocks' last references.
        gpu_pool.free(stores.gpu_block_ids[::-1])
        self._tier_pool.free(stores.tier_block_ids[::-1])
        if selector.set_aside is not None:  # the disk works: suspects come back on trial
            selector.set_aside.note_succeeded(stores.tier_block_ids)


def _held(disk_pool: BlockPool, key: Key, tag: Tag | None) -> bool:
    """Return True when the disk holds what a store of `key` tagged `tag` copied: a copy
    of `key` with that tag (any copy for an untagged store). A copy the token check
    cannot serve (no tag, another tag) does not make the store a promotion."""
    block = disk_pool.cached_block(key)
    return block is not None and (tag is None or disk_pool.tag(block, key) == tag)
