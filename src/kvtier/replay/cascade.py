"""The CPU → DISK cascade of `TierReplay` (`ReplayConfig.cascade`), every transfer instant.

What the offload scheduler's cascade does, synchronously (docs/policies.md):

- **Lookup:** the longest prefix (after the GPU's hits) where each block is in the CPU
  tier or, if the CPU lacks it, on DISK; hits may interleave the two tiers. Each hit is
  pinned in its tier and counted (tokens, TTFT at that tier's link).
- **Stores** go to the CPU tier only, exactly as an independent tier's: the keys the
  CPU lacks (DISK-served blocks included: that is the **promotion**, the disk copy
  stays), CPU admission, eviction per the policy.
- **write_through:** then every block that became cached in the CPU tier is written to
  DISK unless DISK holds it (no admission on DISK; DISK evicts per its own policy). A
  CPU eviction only drops the CPU copy. Before those writes, the DISK copies of the
  request's CPU hits and of the stored blocks DISK already holds are refreshed (moved
  to DISK's most-recently-used end, tail first), as the scheduler does when a CPU load
  completes and when a demotion finds the disk copy present: DISK keeps what the CPU
  serves. A promoted block's DISK copy is not refreshed: the request's DISK hit
  touched it (one use, one touch). With the `scheduler*` orders the DISK loads are
  freed first (after the CPU hits' refresh), as the scheduler frees a load when it lands.
- **write_back:** before the CPU tier allocates each slot, the block that allocation
  would evict (the first of its free queue, `iter_free_after(None)`; the request's own
  pinned blocks are never there), if cached, is **demoted**: inserted into DISK unless
  DISK holds the key, then evicted from the CPU tier (`evict_keys`: the policy records
  it as its own eviction, ghost keys and aging included), so the slot is taken from
  it. Slot by slot equals "the first victims of a batch allocation".

Both tiers evict per `ReplayConfig.policy`; admission applies to the CPU tier only.
Releases follow `ReplayConfig.release_order` in each tier; a demoted block is freed on
DISK at once (so victims enter DISK's recency order oldest first).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.keys import Key
from kvtier.replay.config import CascadeMode, ReleaseOrder
from kvtier.replay.tier_store import (
    Placed,
    TierState,
    release_loads,
    release_request,
    store_missing,
)


class Cascade:
    """Lookup and stores of a CPU tier with a DISK tier behind it."""

    def __init__(
        self, mode: CascadeMode, cpu: TierState, disk: TierState, order: ReleaseOrder
    ) -> None:
        self.mode = mode
        self.cpu = cpu
        self.disk = disk
        self.order = order

    def lookup(self, keys: Sequence[Key], start: int) -> tuple[list[Placed], list[Placed]]:
        """Return the CPU and DISK hits of the prefix from `start` (not pinned yet)."""
        in_cpu = self.cpu.pool.cached_block
        in_disk = self.disk.pool.cached_block
        cpu_hits: list[Placed] = []
        disk_hits: list[Placed] = []
        for j in range(start, len(keys)):
            block_id = in_cpu(keys[j])
            if block_id is not None:
                cpu_hits.append((j, block_id))
                continue
            block_id = in_disk(keys[j])
            if block_id is None:
                break
            disk_hits.append((j, block_id))
        return cpu_hits, disk_hits

    def store(
        self,
        keys: Sequence[Key],
        tokens: Sequence[int],
        cpu_hits: Sequence[Placed],
        disk_hits: Sequence[Placed],
    ) -> None:
        """Store the request's blocks into the CPU tier and feed DISK per the mode."""
        cpu, disk, order = self.cpu, self.disk, self.order
        if self.mode is CascadeMode.WRITE_BACK:
            release_loads(disk, disk_hits, order)
            stored = store_missing(cpu, keys, tokens, cpu_hits, order, make_room=self._demote)
            release_request(disk, disk_hits, (), order)
        else:
            stored = self._store_write_through(keys, tokens, cpu_hits, disk_hits)
            pinned = disk_hits if order is ReleaseOrder.TAIL_FIRST else ()  # else freed
            written = store_missing(
                disk,
                keys,
                tokens,
                pinned,
                order,
                positions=[j for j, _ in stored],
                use_admission=False,
            )
            cpu.demoted += len(written)
            self._release_cpu(cpu_hits, stored, {j for j, _ in written})
        if disk_hits:
            served = {j for j, _ in disk_hits}
            cpu.promoted += sum(1 for j, _ in stored if j in served)

    def _store_write_through(
        self,
        keys: Sequence[Key],
        tokens: Sequence[int],
        cpu_hits: Sequence[Placed],
        disk_hits: Sequence[Placed],
    ) -> list[Placed]:
        """Store into the CPU tier and refresh the DISK copies of its hits and stores.

        A promoted block's DISK copy is not refreshed: the request's DISK hit touched it
        (one use, one touch, as the scheduler counts it). `tail_first`: every hit stays
        pinned until the stores are registered. The scheduler's orders: as the scheduler
        completes the loads before the stores, the CPU hits' DISK copies are refreshed,
        then the DISK loads freed, then the other stores' DISK copies refreshed.
        """
        cpu, order = self.cpu, self.order
        served = {j for j, _ in disk_hits}
        refresh = [j for j, _ in cpu_hits]
        if order is not ReleaseOrder.TAIL_FIRST:
            self._refresh_disk(keys, refresh)
            release_loads(self.disk, disk_hits, order)
            refresh = []
        stored = store_missing(cpu, keys, tokens, cpu_hits, order, release=False)
        self._refresh_disk(keys, refresh + [j for j, _ in stored if j not in served])
        return stored

    def _release_cpu(
        self, hits: Sequence[Placed], stored: Sequence[Placed], written: set[int]
    ) -> None:
        """Free write-through's CPU blocks: in the scheduler's orders, a stored block
        being copied to DISK stays pinned until its copy lands, so it is freed after
        the stores that needed no copy (each group as its order says)."""
        if self.order is ReleaseOrder.TAIL_FIRST:
            release_request(self.cpu, hits, stored, self.order)
            return
        release_request(self.cpu, (), [p for p in stored if p[0] not in written], self.order)
        release_request(self.cpu, (), [p for p in stored if p[0] in written], self.order)

    def _refresh_disk(self, keys: Sequence[Key], positions: list[int]) -> None:
        """Move the free DISK copies of `keys[positions]` to the MRU end, tail first."""
        pool = self.disk.pool
        found = [pool.cached_block(keys[j]) for j in sorted(positions)]
        ids = [b for b in found if b is not None and pool.ref_count(b) == 0]
        if ids:
            pool.touch(ids)
            pool.free(ids[::-1])

    def _demote(self) -> None:
        """Move the CPU tier's next victim, if cached, to DISK (before it is allocated)."""
        cpu_pool, disk_pool = self.cpu.pool, self.disk.pool
        block_id = next(cpu_pool.iter_free_after(None))
        key = cpu_pool.key(block_id)
        if key is None:
            return
        if disk_pool.cached_block(key) is None:
            if disk_pool.can_allocate(1):
                (disk_id,) = disk_pool.allocate(1)
                disk_pool.insert_key(key, disk_id, cpu_pool.num_tokens(block_id))
                disk_pool.free([disk_id])
                self.disk.stored += 1
                self.cpu.demoted += 1
            else:  # every DISK slot is pinned by this request's hits
                self.disk.dropped += 1
        cpu_pool.evict_keys(block_id)  # recorded as the policy's eviction (ghosts, aging)
