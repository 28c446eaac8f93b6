"""What the offload scheduler reports (`OffloadScheduler`'s base): the tiers' events,
the step's counters with the totals, and the gauges of tier blocks in use, blocks pending
store and disk slots held."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import KVEvent
from kvtier.offload.cascade import Cascade
from kvtier.offload.disk_slots import SetAsideSlots
from kvtier.offload.stats import OffloadStats
from kvtier.offload.stats_taking import StatsTaker
from kvtier.offload.store_selection import StoreSelector
from kvtier.offload.tier_index import TierIndex
from kvtier.offload.transfers import TransferBook


class SchedulerObservability(ABC):
    """Events, stats and gauges of the tiers `OffloadScheduler` sets up."""

    tier_pool: BlockPool
    index: TierIndex
    cascade: Cascade | None
    _store_set_aside: SetAsideSlots | None
    _book: TransferBook
    _stats: StatsTaker

    @property
    @abstractmethod
    def selector(self) -> StoreSelector:
        """Return the store selector (`OffloadScheduler.selector`)."""

    @property
    def disk_set_aside(self) -> SetAsideSlots | None:
        """Return the disk slots held after failed writes (`disk_slots`): the cascade's
        demotions', or a disk-only tier's stores'; None without a disk tier."""
        if self.cascade is not None:
            return self.cascade.set_aside
        return self._store_set_aside

    def take_events(self) -> list[KVEvent]:
        """Return and forget the tiers' events (medium = the tier), oldest first per tier."""
        return [event for pool in self.index.pools.values() for event in pool.take_events()]

    def stats_gauges(self) -> tuple[int, int, int]:
        """Return (tier blocks in use, blocks pending store, disk slots held): `take_stats`'s
        gauges, each O(1).

        Pending: blocks queued or in flight towards a tier, GPU -> tier stores and a
        cascade's CPU -> DISK demotions alike. In use: pinned by transfers or lookups,
        not a disk-only tier's held slots of failed stores (`disk_slots`), which an idle
        tier keeps until a reset. Held: the disk slots set aside after failed writes (the
        cascade's demotions' or a disk-only tier's stores'), suspects and bad slots
        together; 0 without a disk tier.
        """
        pool = self.tier_pool
        # A cascade's demotions are blocks towards a tier too (`has_pending_stores`).
        pending = len(self.selector.queued) + self._book.num_store_blocks
        if self.cascade is not None:
            pending += len(self.cascade.queued)
        store_held = len(self._store_set_aside) if self._store_set_aside is not None else 0
        set_aside = self.disk_set_aside
        disk_held = len(set_aside) if set_aside is not None else 0
        return pool.num_usable_blocks - pool.num_free() - store_held, pending, disk_held

    def store_events_in_flight(self) -> tuple[int, int]:
        """Return (store and demotion events issued and not yet reported, how many of
        them a reset abandoned), for messages about what a drain waits for."""
        return self._book.store_events()

    def has_new_counts(self) -> bool:
        """Return True when `take_stats` would report a non-zero counter or new hit tokens."""
        return self._stats.has_new_counts()

    def take_stats(self, gauges: tuple[int, int, int] | None = None) -> OffloadStats:
        """Return this step's counters (then reset them), the gauges and the totals.

        `gauges`: what `stats_gauges` returned just before, with nothing changed since
        (a caller that compared them first need not have them computed twice).
        """
        return self._stats.take(*(self.stats_gauges() if gauges is None else gauges))
