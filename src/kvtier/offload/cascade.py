"""The CPU → DISK half of the tier cascade GPU → CPU → DISK (SPEC §7, Beyond).

`Cascade` owns the disk tier's index (a second `BlockPool`) and chooses demotions:
copies of cached CPU blocks down to disk. `OffloadScheduler` issues them as CPU → DISK
jobs and reports their completion here. Everything else is the scheduler's as for one
tier: GPU stores go to the CPU tier, and a lookup serves each block from the CPU tier,
else from disk (a DISK → GPU load).

    write-through   every block the CPU tier registers is demoted right away
    write-back      a cached CPU block is demoted when it is among the next `reserve`
                    victims of the CPU free queue; once on disk it leaves the CPU tier

A drain (`has_pending_stores`) waits for the demotions in flight, write-back's too: their
reports free the CPU and disk slots they pin. A failed write-back demotion is given up,
not retried in a loop (which kept a drain going for ever): its (CPU block, key) pair is
remembered and not demoted again until a demotion succeeds (the disk works again) or the
block loses that key (evicted, discarded, reset); evicted before that, it counts as a
lost block. So a disk whose every write fails costs at most one failed demotion per
cached CPU block, and an idle engine stops issuing them. Write-back's walk looks past
given-up blocks (`select_write_back`), and a failed demotion's disk slots are set aside
rather than reused first (`disk_slots`), so a few bad slots do not stop every demotion.

Write-through demotes a block only when the CPU tier registers it, so a failed
write-through demotion is retried on later plans, with a back-off and a bounded number of
attempts, and one dropped for want of a free disk slot once slots free up; a plan issues
a bounded number of retries (`demotion_retries`). Retries are not pending stores: a drain
does not wait for them (the CPU copy stays; a plan after the drain retries it).

With the token check on (SPEC §3 Beyond), a CPU block is on disk only where a disk copy
of its key has its tag: a copy with none (restored from a manifest written without the
check) or another tag serves none of its requests, so the CPU copy is demoted in either
mode and replaces it.

Promotion (DISK → CPU, SPEC §1) reuses the GPU copy a disk hit leaves behind: the
block is on the GPU after its load and the CPU tier lacks it, so store selection picks
it like any other block (the CPU tier's admission policy decides whether it is worth
keeping). That costs one host copy instead of a second disk read. The demotion that
store queues finds the disk copy and, unlike for other stored blocks, does not refresh
it: the request's load counted its use (`after_stores`).

Pins, as for GPU ↔ CPU transfers: the CPU source is pinned and the disk destination is
freshly allocated, both until every worker reported the move. The destination's keys
are registered only when every worker succeeded and the CPU block still holds them; a
failed or abandoned move registers nothing (the disk copy is lost, never corrupt). A
persistent tier's manifest drops the records of disk copies the cascade drops or does not
register (`dropped_slots`), so a restart does not restore them either.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Sequence

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import Key
from kvtier.offload.config import CascadeMode
from kvtier.offload.demotion_completion import CascadeCounters as CascadeCounters
from kvtier.offload.demotion_completion import DemotionCompletion
from kvtier.offload.demotion_completion import MoveItem as MoveItem
from kvtier.offload.demotion_retries import MAX_DEMOTION_ATTEMPTS as MAX_DEMOTION_ATTEMPTS
from kvtier.offload.disk_slots import SetAsideSlots
from kvtier.offload.dropped_slots import DroppedSlots

# The write-back walk visits at most this many times `reserve` free CPU blocks.
_WALK_SPAN = 4


def _check_bound(name: str, value: int) -> int:
    """Return `value` as an int, or raise ValueError naming it unless it is an int >= 1:
    a float bound (2.5) was never reached by the walks' counts, which ran to their span."""
    try:
        bound = operator.index(value)
    except TypeError:
        bound = 0
    if bound < 1 or isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return bound


class Cascade(DemotionCompletion):
    """Choose CPU → DISK demotions and register them when they complete."""

    def __init__(
        self,
        cpu_pool: BlockPool,
        disk_pool: BlockPool,
        mode: CascadeMode,
        reserve: int,
        event: Callable[[Key, int | None], BlockStored] | None = None,
        dropped: DroppedSlots | None = None,
        retries_per_plan: int | None = None,
    ) -> None:
        """`reserve`: write-back's window of next CPU victims. `retries_per_plan`:
        write-through's bound on the retries a plan issues (None: `reserve`, both being
        the demotions a plan may add to a step's own; `scheduler_setup` derives them)."""
        reserve = _check_bound("reserve", reserve)
        if retries_per_plan is None:
            retries_per_plan = reserve
        retries_per_plan = _check_bound("retries_per_plan", retries_per_plan)
        self.cpu_pool = cpu_pool
        self.disk_pool = disk_pool
        self.mode = mode
        self.reserve = reserve
        self.retries_per_plan = retries_per_plan
        self.queued: list[MoveItem] = []
        self.in_flight_keys: set[Key] = set()
        self.counters = CascadeCounters()
        # (CPU block, key) pairs counted as dropped demotions: write-back retries a victim
        # each step while no disk slot frees, and it counts once. A pair goes when its
        # block is demoted, found on disk, evicted or has its keys discarded
        # (`before_cpu_discard`).
        self.dropped: set[tuple[int, Key]] = set()
        # Write-back: (CPU block, key) pairs whose demotion failed, not demoted again; they
        # go as `dropped`'s do, and all at once when a demotion succeeds.
        self.failed: set[tuple[int, Key]] = set()
        # Write-through: (CPU block, key) pairs whose demotion failed (or was dropped: 0)
        # → attempts so far; retried (`select_retries`, a bounded number a plan) until one
        # succeeds or MAX_DEMOTION_ATTEMPTS failed.
        # They go as `dropped`'s do, and when the key is found on disk. In flight, a retry
        # waits in `retrying`: plans do not walk them (after a long fault, a CPU tier's).
        self.retry: dict[tuple[int, Key], int] = {}
        self.retrying: dict[tuple[int, Key], int] = {}
        self._num_plans = 0  # `select_retries` calls
        self._retry_at = 0  # the plan number from which retries are due
        self._failures_in_a_row = 0  # failed demotion reports since the last success
        self.set_aside = SetAsideSlots(disk_pool)  # disk slots of failed demotions
        self._event = event
        # Disk copies dropped or not registered: their manifest records go too.
        self.dropped_slots = dropped if dropped is not None else DroppedSlots(active=False)
        cpu_pool.on_evict = self._on_cpu_evict
        if event is not None:  # demotions' disk events reuse the CPU events' payloads
            cpu_pool.keep_payloads()

    # ------------------------------------------------------------ selection

    def after_stores(self, cpu_block_ids: Sequence[int], loaded: Collection[int] = ()) -> None:
        """Write-through: demote blocks the CPU tier has just registered (still pinned).

        A block already on disk has its disk copy refreshed, as a use by the request
        that stored it, except at the indices in `loaded` (`LoadedBlocks.take_stores`):
        the load that filled the GPU block counted that use of the copy (one use, one
        touch: S3-FIFO and LFU-DA count touches)."""
        if self.mode is CascadeMode.WRITE_THROUGH:
            counted = {cpu_block_ids[i] for i in loaded} if loaded else None
            self._demote(cpu_block_ids, counted)

    def select_write_back(self) -> None:
        """Write-back: demote the cached blocks among the CPU tier's next victims.

        The window holds the next `reserve` victims that are not given up (`failed`): the
        walk looks past those, which the disk could not take, so they neither shrink the
        window nor, once they fill it, stop every demotion (then none succeeds to show the
        disk works again, and the blocks behind them were evicted undemoted). It visits at
        most `_WALK_SPAN` times `reserve` free blocks, so a step's walk stays short when a
        failing disk left most of a large CPU tier given up.
        """
        if self.mode is not CascadeMode.WRITE_BACK:
            return
        key, failed = self.cpu_pool.key, self.failed
        victims = []
        left = self.reserve
        visits = _WALK_SPAN * self.reserve
        for block_id in self.cpu_pool.iter_free_after(None):
            visits -= 1
            k = key(block_id)
            if k is None or not failed or (block_id, k) not in failed:
                if k is not None:
                    victims.append(block_id)
                left -= 1
            if not left or not visits:
                break
        self._demote(victims)

    def _demote(self, cpu_block_ids: Iterable[int], counted: set[int] | None = None) -> None:
        """Queue copies of the cached CPU blocks the disk lacks; refresh (write-through)
        the disk copies of the others but those of `counted`."""
        cpu_pool, disk_pool = self.cpu_pool, self.disk_pool
        chosen: list[tuple[int, Key]] = []
        on_disk: list[int] = []
        through = self.mode is CascadeMode.WRITE_THROUGH
        for block_id in cpu_block_ids:
            key = cpu_pool.key(block_id)
            if key is None:
                continue
            # Looked up before the copies in flight: a key held on disk by another block's
            # demotion (a secondary key) may be in flight as well.
            disk_block = self._disk_copy(block_id, key)
            if disk_block is not None:  # held on disk (maybe by another block's demotion):
                if counted is None or block_id not in counted:  # nothing to retry, nor
                    on_disk.append(disk_block)  # dropped any more
                if self.retry:
                    self.retry.pop((block_id, key), None)
                if self.dropped:
                    self.dropped.discard((block_id, key))
                continue
            if key in self.in_flight_keys:  # not copied twice at once
                # Write-through: demoted once that copy lands. It may be another block's,
                # whose keys were discarded since (a failed load): it registers nothing.
                if through and (block_id, key) not in self.retrying:
                    self.retry.setdefault((block_id, key), 0)
                continue
            chosen.append((block_id, key))
        if self.mode is CascadeMode.WRITE_THROUGH:
            self._refresh(on_disk)
        if not chosen:
            return
        self.set_aside.make_room(len(chosen))
        room = min(len(chosen), disk_pool.num_free())
        dropped, retry = self.dropped, self.retry
        for pair in chosen[room:]:
            if pair not in dropped:
                dropped.add(pair)
                self.counters.num_dropped_demotions += 1
            if through and pair not in retry:  # once a slot frees; no attempt spent
                retry[pair] = 0
        chosen = chosen[:room]
        if dropped:
            dropped.difference_update(chosen)
        cpu_pool.pin(block_id for block_id, _ in chosen)  # a copy reads them: no hit
        disk_ids = disk_pool.allocate(len(chosen))
        for (block_id, key), disk_id in zip(chosen, disk_ids, strict=True):
            self.in_flight_keys.add(key)
            self.queued.append(MoveItem(block_id, disk_id, key, cpu_pool.num_tokens(block_id)))

    def _disk_copy(self, cpu_block_id: int, key: Key) -> int | None:
        """Return the disk block that holds what CPU block `cpu_block_id` holds under its
        primary key `key`, or None.

        With the token check on, a CPU copy tagged T is held on disk only by a disk copy
        of `key` tagged T: one with no tag (a manifest written without the check) or
        another tag serves none of the requests the CPU copy serves, so the CPU copy is
        demoted to replace it (`_register`). An untagged CPU copy serves no request
        either: any disk copy is as good.
        """
        disk_block = self.disk_pool.cached_block(key)
        if disk_block is None:
            return None
        tag = self.cpu_pool.tag(cpu_block_id)
        if tag is not None and self.disk_pool.tag(disk_block, key) != tag:
            return None
        return disk_block

    def after_cpu_loads(self, cpu_block_ids: Sequence[int]) -> None:
        """Write-through: a CPU hit refreshes the block's disk copy too.

        Otherwise a block the CPU keeps hot would age out of the disk, and the disk
        would stop holding what the CPU holds (what a restart relies on).
        """
        if self.mode is not CascadeMode.WRITE_THROUGH:
            return
        key, disk_get = self.cpu_pool.key, self.disk_pool.cached_block
        found = (disk_get(k) for k in map(key, cpu_block_ids) if k is not None)
        self._refresh([b for b in found if b is not None])

    def _refresh(self, disk_block_ids: list[int]) -> None:
        """Move free disk blocks to the most-recently-used end (pinned ones stay put)."""
        if disk_block_ids:
            self.disk_pool.touch(disk_block_ids)
            self.disk_pool.free(disk_block_ids[::-1])

    def before_cpu_discard(self, block_id: int) -> None:
        """Forget a dropped demotion of CPU block `block_id`, whose keys are being
        discarded (a failed load): stored again later, it is a new victim."""
        key = self.cpu_pool.key(block_id)
        if key is not None:
            self.dropped.discard((block_id, key))
            self.failed.discard((block_id, key))
            self.retry.pop((block_id, key), None)
            self.retrying.pop((block_id, key), None)  # its copy in flight registers nothing

    def _on_cpu_evict(self, block_id: int, key: Key) -> None:
        """Count a CPU eviction that loses the block: no disk copy, none in flight."""
        self.dropped.discard((block_id, key))
        self.failed.discard((block_id, key))
        self.retry.pop((block_id, key), None)
        self.retrying.pop((block_id, key), None)
        if key not in self.in_flight_keys and self._disk_copy(block_id, key) is None:
            self.counters.num_lost_blocks += 1

    def forget_all(self) -> None:
        """Forget every dropped and failed demotion (a reset discards the keys) and give
        back the disk slots set aside."""
        self.dropped.clear()
        self.failed.clear()
        self.retry.clear()
        self.retrying.clear()
        self._retry_at = self._failures_in_a_row = 0
        self.set_aside.clear()

    def take_queued(self) -> list[MoveItem]:
        """Return and forget the demotions selected since the last call."""
        queued, self.queued = self.queued, []
        return queued

    def take_counters(self) -> CascadeCounters:
        """Return the counters since the last call and reset them."""
        counters, self.counters = self.counters, CascadeCounters()
        return counters
