"""Admission of a waiting request (SPEC §2.2): its local GPU prefix hit, then kvtier's
`lookup`, its blocks, `on_allocated`; a request with external tokens waits for its load.
What it takes is recorded in the statements that take it, so a Ctrl-C leaves a request
the scheduler's `_settle` can finish admitting or rewind."""

from __future__ import annotations

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.longest_hit import find_longest_hit
from kvtier.engine.block_counts import (
    first_needed_block,
    most_that_fit,
    num_blocks_after,
    num_hit_blocks,
    num_new_blocks,
)
from kvtier.engine.block_growth import BlockGrowth
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.scheduler_step import SchedulerLimits


class Admission(BlockGrowth):
    """Admit a waiting request into the GPU pool (a base of `Scheduler`)."""

    limits: SchedulerLimits

    def _admit(self, request: Request, budget: int, shrink: bool = False) -> int | None:
        """Give a waiting request its cached prefix and blocks; return tokens to run now.

        Returns None when the GPU pool cannot hold the request. The request and the pool
        are then left as they were, but the tier hit its lookup found stays pinned
        (SPEC §6.2) until the request's next lookup, finish or abort releases it. With
        `shrink`, the first chunk is cut to the longest that fits (any length): a
        sliding-window group holds every block of a chunk while it is computed, so a
        whole prompt in one chunk can need more blocks than the pool, though its chunks
        one by one fit (out-of-window blocks are freed after each chunk).
        """
        if request.num_computed_tokens > 0:  # back from a load: its blocks are in place
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            return self._shrink_to_fit(request, num_new)
        local = find_longest_hit(
            self.layout, request.block_hashes, request.num_tokens - 1, self.pool.cached_block
        )
        num_local = local.num_tokens
        num_external = 0
        if self.offload is not None:
            # Looked up even when recomputing (a failed load): the lookup records the
            # local prefix, below which the request's blocks are other requests' fills
            # (the token check tags only the request's own fills).
            cap = 0 if request.skip_external else None
            num_external = self.offload.lookup(request, num_local, cap)
        num_hit = num_local + num_external
        num_new = 0 if num_external else min(request.num_tokens - num_hit, budget)
        layout = self.layout
        # Per group, the first block the token after the whole hit (local + external)
        # attends to: a sliding-window group does not hold the local hit's blocks before
        # it (they were picked for a hit ending at num_local). Held, they would be
        # counted, touched and kept until the next step's window drop, and a request
        # that fits the pool could stall with them and be aborted.
        first_needed = [first_needed_block(layout, g, num_hit) for g in range(len(layout.groups))]
        hits = [
            [NULL_BLOCK_ID if pos < first_needed[g] else b for pos, b in enumerate(block_ids)]
            for g, block_ids in enumerate(local.block_ids)
        ]
        num_fresh = num_hit_blocks(layout, num_local, num_hit) + num_blocks_after(
            layout, num_hit, num_new
        )
        # Hit blocks still in the free queue leave it when touched: count them first, so a
        # request that does not fit leaves the queue's order (and a lazy walk) untouched.
        ref_count = self.pool.ref_count
        num_free_hits = sum(
            1 for table in hits for b in table if b != NULL_BLOCK_ID and ref_count(b) == 0
        )
        if shrink and num_new > 1 and not self.pool.can_allocate(num_fresh + num_free_hits):
            hit_blocks = num_hit_blocks(layout, num_local, num_hit) + num_free_hits
            fits = most_that_fit(
                num_new,
                lambda n: self.pool.can_allocate(hit_blocks + num_blocks_after(layout, num_hit, n)),
            )
            if fits is not None:
                num_new = fits
                num_fresh = hit_blocks - num_free_hits + num_blocks_after(layout, num_hit, num_new)
        num_taken = num_fresh + num_free_hits
        if num_external and not self._has_room_after_load(request, num_hit, num_taken, shrink):
            return None
        if not self.pool.can_allocate(num_taken):
            return None
        # The request's tables take each block in the statement that takes it from the
        # pool: cut short before it counts them as computed, `_settle` frees them.
        tables: list[list[int]] = [[] for _ in hits]
        request.block_tables = tables  # it held none: waiting, nothing computed
        for group_id, table in enumerate(hits):
            tables[group_id] = _touched(self.pool, table)
        for group_id, group in enumerate(self.layout.groups):
            for pos in range(num_local // group.block_size, num_hit // group.block_size):
                fresh = pos >= first_needed[group_id]
                tables[group_id].append(self.pool.allocate(1)[0] if fresh else NULL_BLOCK_ID)
        r = request
        # Its hits are those of the admission its first token comes from: re-admitted
        # before it (e.g. back from a load), only the latest counts, never more than the
        # prompt. Set, not added, in the statement that admits it: cut short, it is
        # `_settle`d as admitted with them, or rewound (`rewind` takes the load's back).
        first = r.first_token_time is None
        local_hit = num_local if first else r.num_local_tokens_total
        external_hit = num_external if first else r.num_external_tokens_total
        if num_external:
            # Loading before its load is queued, in one statement: an interrupt never
            # leaves it waiting with tokens a pending load is still writing (it would run
            # on them); one cut short before the load was queued is rewound (`_settle`).
            # Its targets on one line: Python runs no line (no interrupt) between them.
            r.status, r.num_external_tokens, r.num_external_tokens_total, r.num_computed_tokens = (
                RequestStatus.WAITING_FOR_LOAD,
                num_external,
                external_hit,
                num_hit,
            )
            request.num_local_tokens_total = local_hit
        else:
            r.num_computed_tokens, r.num_local_tokens_total, r.num_external_tokens_total = (
                num_hit,
                local_hit,
                external_hit,
            )
        if self.offload is not None:
            self.offload.on_allocated(request, tables, num_external)
        return num_new

    def _has_room_after_load(
        self, request: Request, num_hit: int, num_taken: int, shrink: bool
    ) -> bool:
        """Return True when the pool holds the `num_taken` blocks of a request's hit, the
        blocks of the chunk it computes once its load is done, and those the requests
        loading now need for theirs (vLLM's reservation for in-flight prefills).

        A load holds its blocks for a step or more without progress. Admitted where only
        its hit fits (while requests run, which grow meanwhile), a request back from its
        load found no room for its chunk and held its blocks idle until a running one,
        short of blocks, freed them (a preemption) and its hit was loaded again. With
        offload off it would have waited for room for its hit and chunk together: so it
        waits here too. With `shrink` and no load in flight (it would run alone), its
        chunk is one token.
        """
        layout, limit = self.layout, self.limits.max_num_batched_tokens
        alone = shrink and not self.loading  # else a load in flight frees room
        num_next = 1 if alone else min(request.num_tokens - num_hit, limit)
        num_blocks = num_taken + num_blocks_after(layout, num_hit, num_next)
        for other in self.loading.values():
            num_other = min(other.num_tokens - other.num_computed_tokens, limit)
            num_blocks += num_new_blocks(layout, other, num_other)
        return self.pool.can_allocate(num_blocks)


def _touched(pool: BlockPool, block_ids: list[int]) -> list[int]:
    """Take one more reference on `block_ids`; return them, for the caller to record in
    the statement that takes them (`Scheduler._admit`)."""
    pool.touch(block_ids)
    return block_ids
