"""How a scheduled request's GPU blocks grow: the blocks more tokens need, the most
tokens that fit the pool, whether a request holds the pool alone, whether transfers are
about to give blocks back, and the step's entry that carries the new blocks (or the
whole tables, after a preemption)."""

from __future__ import annotations

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.kv_groups import KVLayout
from kvtier.engine.block_counts import most_that_fit, num_new_blocks
from kvtier.engine.request import Request
from kvtier.engine.scheduler_step import ScheduledWork
from kvtier.offload.protocols import TableUpdate
from kvtier.offload.scheduler import OffloadScheduler


class BlockGrowth:
    """Grow a request's block tables in the GPU pool (a base of `Scheduler`)."""

    layout: KVLayout
    pool: BlockPool
    running: list[Request]
    loading: dict[str, Request]
    offload: OffloadScheduler | None

    def _shrink_to_fit(self, request: Request, num_new: int) -> int | None:
        """Return the most of `num_new` tokens whose blocks fit the pool (None if none)."""
        free = self.pool.num_free()
        return most_that_fit(num_new, lambda n: num_new_blocks(self.layout, request, n) <= free)

    def _holds_the_pool(self, request: Request) -> bool:
        """Return True when `request` runs alone and every other block is free."""
        if len(self.running) != 1 or self.loading:
            return False
        own = {b for table in request.block_tables for b in table if b != NULL_BLOCK_ID}
        return self.pool.num_free() + len(own) >= self.pool.num_usable_blocks

    def _frees_pending(self) -> bool:
        """Return True when a transfer holds the last reference on a GPU block: it goes
        back to the pool once the worker reports the copy (every queued transfer is
        issued by the next plan, every issued one is reported, failed or not), so a
        request short of blocks waits for it rather than preempting one (vLLM's
        `has_pending_block_frees`). The finished requests' stores, lazy stores and the
        loads of aborted requests hold such blocks."""
        return self.offload is not None and self.offload.holds_gpu_blocks_alone()

    def _work(self, request: Request, num_new: int, new_ids: list[list[int]]) -> ScheduledWork:
        if request.needs_full_table:
            request.needs_full_table = False
            ids = tuple(tuple(table) for table in request.block_tables)
            return ScheduledWork(request, num_new, ids, TableUpdate.REPLACE)
        return ScheduledWork(request, num_new, tuple(map(tuple, new_ids)), TableUpdate.APPEND)

    def _grow(self, request: Request, num_new: int) -> list[list[int]] | None:
        """Append the blocks `num_new` more tokens need; None if the pool is short.

        A table takes its blocks in the statement that takes them from the pool: cut
        short (an interrupt) between the two, they would be in no table, never freed.
        The offload side learns of them from this step's plan: grown again before
        `complete` applied the last work (the step that grew it, or cleared its
        `needs_full_table`, was cut short), the request sends its tables whole."""
        if num_new_blocks(self.layout, request, num_new) > self.pool.num_free():
            return None
        if request.has_unconfirmed_work:
            request.needs_full_table = True
        request.has_unconfirmed_work = True
        new_ids = []
        for group, table in zip(self.layout.groups, request.block_tables, strict=True):
            need = -(-(request.num_computed_tokens + num_new) // group.block_size)
            table.extend(fresh := self.pool.allocate(max(0, need - len(table))))
            new_ids.append(fresh)
        return new_ids
