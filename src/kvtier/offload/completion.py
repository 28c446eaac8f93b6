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
from kvtier.offload.transfers import (
    FailedLoad,
    IssuedTransfer,
    LoadItem,
    LoadProgress,
    ReportOutcome,
    TransferBook,
)

_NOTHING = ReportOutcome()
# A load part's completion steps: free its tier blocks, free its GPU blocks, settle, note.
_LOAD_STEPS = 4


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
        # Loads finished or failed by the steps applied, until `outcome_taken`.
        self._finished: list[str] = []
        self._failed: list[FailedLoad] = []
        self._suspects: dict[str, tuple[int, ...]] = {}  # of the failed loads

    def apply(self, report: WorkerReport) -> ReportOutcome:
        """Apply worker completions: register stored keys, release pins, finish loads.

        Returns the loads finished or failed since the last `outcome_taken`: a call cut
        short (KeyboardInterrupt) leaves them to the next. Safe to cut short and apply
        again: each complete event stays in the book until all its steps are applied,
        and the next call goes on from the step it reached (`_apply_steps`). One while
        `TransferBook.complete` adds up the report's counts makes the events it counted
        complete as failed on the next call (counted twice).
        """
        if self._book.has_unissued_failures():
            num_failed = len(self._failed)
            self._failed += self._book.take_unissued_failures()  # one line: none lost
            self._counters.num_failed_loads += len(self._failed) - num_failed
        for transfer in self._book.complete(report):
            selector = self.selector
            assert selector is not None, "no GPU pool bound"
            self._apply_steps(transfer, selector)
            self._book.forget(transfer)
        if not self._finished and not self._failed:
            return _NOTHING
        return ReportOutcome(tuple(self._finished), tuple(self._failed), dict(self._suspects))

    def outcome_taken(self) -> None:
        """Forget the loads `apply` returned: the caller acted on them."""
        if self._finished or self._failed:
            self._finished, self._failed, self._suspects = [], [], {}

    def _apply_steps(self, transfer: IssuedTransfer, selector: StoreSelector) -> None:
        """Apply the steps of `transfer` from `IssuedTransfer.num_applied` on.

        A step that releases pins (a load's tier blocks, its GPU blocks, the stores, the
        moves) is counted before it runs: an interrupt inside it leaves some pinned for
        good (a leak), where running it again would release pins twice (a pool error,
        or another holder's block freed under it: wrong KV). A load's count of pending
        parts is taken down in the statement that counts its step (never twice, never
        skipped), and the finished or failed load is noted once (`_note_done`).
        """
        loads = transfer.loads
        if transfer.num_applied == 0:
            num_copied = transfer.num_copied_blocks()
            if num_copied:  # a partly failed load counts the blocks it copied whole
                self._counters.count_transfer(transfer.transfer_type, num_copied, transfer.seconds)
            transfer.num_applied = 1
        while (step := transfer.num_applied - 1) < _LOAD_STEPS * len(loads):
            load, part = loads[step // _LOAD_STEPS], step % _LOAD_STEPS
            if part == 0:
                transfer.num_applied += 1
                # Tail first (SPEC §4), so a prefix's tail is evicted before its root.
                self._index.pools[load.tier].free(load.tier_block_ids[::-1])
            elif part == 1:
                transfer.num_applied += 1
                selector.gpu_pool.free(load.gpu_block_ids[::-1])
            elif part == 2:
                self._settle_load(transfer, load, selector)
            else:
                self._note_done(load.progress)
                transfer.num_applied += 1
        stores_step = 1 + _LOAD_STEPS * len(loads)
        if transfer.num_applied == stores_step:
            transfer.num_applied += 1
            if transfer.stores:
                self._complete_stores(transfer, selector)
        if transfer.num_applied == stores_step + 1:
            transfer.num_applied += 1
            if transfer.moves:
                assert self._cascade is not None
                self._cascade.complete(transfer.moves, transfer.succeeded, transfer.abandoned)

    def _settle_load(
        self, transfer: IssuedTransfer, load: LoadItem, selector: StoreSelector
    ) -> None:
        """Count a load part's blocks, or discard its suspect ones; take it off its
        request's pending parts in the statement that counts the step.

        With a cascade, the GPU blocks a load filled are noted (`loaded_blocks`): the load
        counted its use of their disk copies (DISK: the lookup's touch; CPU:
        `after_cpu_loads`), which their first store's demotion must not count again."""
        progress = load.progress
        # A failed event whose workers named its bad blocks copied every other block
        # whole: only the loads reading a bad one fail.
        suspect = transfer.suspect(load.tier_block_ids)
        if not suspect:
            self._counters.num_loaded_blocks += len(load.tier_block_ids)
            if self._cascade is not None:
                # The tier blocks, freed in an earlier step, keep their keys till reused.
                keys = self._index.pools[load.tier].keys(load.tier_block_ids)
                selector.loaded.note_loaded(load.request_id, load.gpu_block_ids, keys)
                if load.tier is Tier.CPU:
                    self._cascade.after_cpu_loads(load.tier_block_ids)
        else:
            progress.failed = True
            progress.failed_whole |= not transfer.bad_blocks  # no bad block named
            bad = set(suspect)
            gpu_blocks = zip(load.tier_block_ids, load.gpu_block_ids, strict=True)
            progress.suspect_gpu_blocks += [gpu for tier, gpu in gpu_blocks if tier in bad]
            pool = self._index.pools[load.tier]
            for block_id in suspect:  # never serve a suspect copy again
                if self._cascade is not None and load.tier is Tier.CPU:
                    self._cascade.before_cpu_discard(block_id)
                pool.discard_keys(block_id)
            if load.tier is Tier.DISK and self._dropped is not None:
                self._dropped.add(suspect)  # nor after a restart
        # One statement: an interrupt lands before it (redone) or after it (done).
        pending, applied = progress.num_pending - 1, transfer.num_applied + 1
        progress.num_pending, transfer.num_applied = pending, applied

    def _note_done(self, progress: LoadProgress) -> None:
        """Note the request's load finished or failed once its last part settled; a
        call that repeats it (an interrupt in between) notes nothing more. The load of a
        request that finished meanwhile is noted nowhere (`TransferBook.drop_outcomes`)."""
        if progress.num_pending != 0 or progress.request_gone:
            return
        if progress.failed:
            failure = progress.failure()
            if failure not in self._failed:
                self._failed.append(failure)
                self._suspects[progress.request_id] = tuple(progress.suspect_gpu_blocks)
                self._counters.num_failed_loads += 1
        elif progress.request_id not in self._finished:
            self._finished.append(progress.request_id)
            self._hit_tokens.update(progress.tier_tokens)

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
            loaded = selector.loaded.take_stores(stores)
            self._cascade.after_stores(stores.tier_block_ids, loaded)
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
