"""Completion of CPU → DISK demotions: what a `Cascade` does with their workers' reports.

`DemotionCompletion`, a mixin of `Cascade` (cascade.py, which chooses the demotions),
registers a demotion's keys on disk when every worker succeeded and the CPU block still
holds them, gives up (write-back) or queues for a retry (write-through,
`WriteThroughRetries`) a failed one, and releases the pins: the CPU source's, and the disk
destination's (a failed one's slots set aside). A write-back demotion that landed takes
its block out of the CPU tier. A disk event reuses the payload of the key's CPU event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kvtier.core.events import BlockStored
from kvtier.core.keys import Key
from kvtier.offload.config import CascadeMode
from kvtier.offload.demotion_retries import WriteThroughRetries
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.plan import SlotRecord


@dataclass(slots=True)
class MoveItem:
    """One cached CPU block being copied to one disk slot."""

    cpu_block_id: int
    disk_block_id: int
    key: Key
    num_tokens: int


@dataclass(slots=True)
class CascadeCounters:
    """Demotions since the last `take_counters`."""

    num_demoted_blocks: int = 0
    # Per attempt: write-back once per (CPU block, key) until one succeeds; write-through
    # at most MAX_DEMOTION_ATTEMPTS times per (CPU block, key).
    num_failed_demotions: int = 0
    num_dropped_demotions: int = 0  # no disk slot could be allocated (once per CPU key)
    num_lost_blocks: int = 0  # evicted from the CPU tier with no disk copy (nor one coming)


class DemotionCompletion(WriteThroughRetries):
    """The completion half of a `Cascade`, over the state its `__init__` sets up."""

    mode: CascadeMode
    failed: set[tuple[int, Key]]
    counters: CascadeCounters
    dropped_slots: DroppedSlots
    _event: Callable[[Key, int | None], BlockStored] | None

    def complete(self, items: Sequence[MoveItem], succeeded: bool, abandoned: bool) -> None:
        """Register finished demotions on disk (or drop failed ones) and release pins."""
        cpu_pool, disk_pool = self.cpu_pool, self.disk_pool
        attempts = self._reported_retries(items)  # back to `retry` if failed
        if not succeeded:
            self.counters.num_failed_demotions += len(items)
            if not abandoned and self.mode is CascadeMode.WRITE_BACK:  # give them up
                self.failed.update(
                    (item.cpu_block_id, item.key)
                    for item in items
                    if cpu_pool.key(item.cpu_block_id) == item.key
                )
            if not abandoned and self.mode is CascadeMode.WRITE_THROUGH:
                self._note_failed_write_through(items, attempts)
        elif not abandoned:  # the disk works again: retry the failed ones
            self.failed.clear()
            self._retry_at = self._failures_in_a_row = 0
        registered = succeeded and not abandoned
        disk_ids = [item.disk_block_id for item in items]
        if not succeeded:  # another worker may have written (and recorded) the slots
            self.dropped_slots.add(disk_ids)
        for item in items:
            if not abandoned:  # an abandoned move's key was let go at the reset
                self.in_flight_keys.discard(item.key)
            # A failed load may have discarded the CPU copy's keys since: then the bytes
            # read are suspect too, and nothing is registered (nor left in the manifest).
            if registered and cpu_pool.key(item.cpu_block_id) == item.key:
                self._register(item)
                if self.retry:
                    self.retry.pop((item.cpu_block_id, item.key), None)
            elif registered:
                self.dropped_slots.add([item.disk_block_id])
        if succeeded or abandoned:
            # Write-through's moves are a request's stores, in position order: tail first,
            # as every release. Write-back's are CPU victims, oldest first: freed in that
            # order, they keep the CPU's order on disk (a prefix freed tail first in the
            # CPU tier is evicted tail first from the disk too; reversed, root first).
            back = self.mode is CascadeMode.WRITE_BACK
            disk_pool.free(disk_ids if back else disk_ids[::-1])
            if registered:
                self.set_aside.note_succeeded(disk_ids)
        else:  # a bad slot would be reused first, failing every later job: held instead
            self.set_aside.note_failed(disk_ids)
        moved: list[int] = []  # write-back: a moved block leaves the CPU tier, unless a
        if registered and self.mode is CascadeMode.WRITE_BACK:  # load pinned it meanwhile
            moved = [
                item.cpu_block_id
                for item in items
                if cpu_pool.ref_count(item.cpu_block_id) == 1
                and cpu_pool.key(item.cpu_block_id) == item.key
            ]
        gone = set(moved)
        cpu_pool.free([item.cpu_block_id for item in items[::-1] if item.cpu_block_id not in gone])
        for block_id in moved:  # the policy's eviction (ghosts, aging), from the pin's spot
            cpu_pool.release_evicted(block_id)

    def _register(self, item: MoveItem) -> None:
        disk_pool = self.disk_pool
        tag = self.cpu_pool.tag(item.cpu_block_id)  # the CPU block's primary key is item.key
        if tag is not None:  # it replaces disk copies the token check cannot serve
            for stale in disk_pool.cached_blocks(item.key):
                if disk_pool.key(stale) != item.key:  # a secondary key (no tag): only it
                    disk_pool.discard_secondary_key(stale, item.key)  # goes, not the block
                elif disk_pool.tag(stale) != tag:  # its secondary keys go with it
                    disk_pool.discard_keys(stale)
                    self.dropped_slots.add([stale])  # a restart must not restore it either
        cpu_pool, cpu_block_id = self.cpu_pool, item.cpu_block_id
        keys = [item.key, *cpu_pool.secondary_keys(cpu_block_id)]
        num_tokens: int | None = item.num_tokens  # a secondary key's count is not recorded
        for key in keys:
            event = None if self._event is None else self._event(key, num_tokens)
            kept = cpu_pool.payload(cpu_block_id, key)  # the CPU event's, while it holds `key`
            if event is not None and kept is not None:
                event = replace(kept, medium=event.medium)
            disk_pool.insert_key(key, item.disk_block_id, item.num_tokens, event, tag)
            tag, num_tokens = None, None  # a tag goes with the primary key only
        self.counters.num_demoted_blocks += 1

    def release(self, items: Iterable[MoveItem]) -> None:
        """Drop the pins and in-flight keys of demotions that will register nothing."""
        items = list(items)
        self.in_flight_keys.difference_update(item.key for item in items)
        self.complete(items, succeeded=True, abandoned=True)

    def records(self, items: Sequence[MoveItem]) -> tuple[SlotRecord, ...]:
        """Return what each demotion's disk slot will hold, for a persistent disk tier."""
        tag = self.cpu_pool.tag  # the CPU block's primary key is the item's while it moves
        return tuple(
            SlotRecord(item.key, item.num_tokens, tag(item.cpu_block_id)) for item in items
        )
