"""Scheduler decisions in states that random workloads seldom reach, built directly.

Each test puts requests into the scheduler's queues with blocks taken from the pool, as
earlier steps would have left them, and pins GPU blocks as an offload transfer in flight
does (a copy reads them: they stay taken until the worker reports it). The pool is kept
small so that a single block decides. Only the scheduling decision is checked (the KV in
those blocks was never computed).
"""

from __future__ import annotations

import dataclasses

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import FinishReason, SamplingParams
from kvtier.offload.protocols import TableUpdate

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def pinned_block(llm: LLM) -> int:
    """Return a block that only a transfer holds (a finished request's store in flight)."""
    (block,) = llm.pool.allocate(1)
    llm.pool.pin([block])
    llm.pool.free([block])
    return block


def placed(llm: LLM, request: Request, num_computed: int, table: list[int]) -> Request:
    """Give a queued request `table` (one group) and `num_computed` computed tokens."""
    request.block_tables = [table]
    request.num_computed_tokens = num_computed
    return request


def running(llm: LLM, prompt: list[int], num_computed: int) -> Request:
    """Return a request running with the blocks of its `num_computed` tokens."""
    request = llm.add_request(prompt, ONE)
    scheduler = llm.scheduler
    scheduler.waiting.remove(request)
    size = llm.engine_config.block_size
    placed(llm, request, num_computed, llm.pool.allocate(-(-num_computed // size)))
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return request


def test_a_head_back_from_its_load_waits_for_a_pinned_block_and_is_not_aborted() -> None:
    """Sliding-window layers only (window 8, blocks of 4): the head is back from its load
    of 12 tokens, holding the null block where the window left and blocks 1 and 2. It
    needs one more block; the pool's third is pinned by a store in flight. It must wait
    for it, not be taken for a request that never fits the pool.
    Mutation: `_is_stalled` counted the null block as one of the head's own blocks (the
    step raised "no progress possible" and aborted the head)."""
    model = dataclasses.replace(
        ModelConfig.tiny(),
        layer_kinds=(AttentionKind.SLIDING, AttentionKind.SLIDING),
        sliding_window=8,
    )
    llm = LLM(model, engine=EngineConfig(block_size=4, num_gpu_blocks=4))  # 3 usable
    head = llm.add_request(list(range(13)), ONE)
    placed(llm, head, 12, [NULL_BLOCK_ID, *llm.pool.allocate(2)])
    store = pinned_block(llm)
    assert llm.pool.num_free() == 0
    assert llm.step() == []
    assert head.status is RequestStatus.WAITING
    assert llm.scheduler.waiting[0] is head
    llm.pool.free([store])  # the store is reported
    assert llm.step() == [head]
    assert head.finish_reason is FinishReason.LENGTH
    llm.shutdown()


def test_a_grow_short_after_one_preemption_preempts_the_next_one_too() -> None:
    """Full attention, blocks of 4, 4 usable: the oldest request needs one block for its
    next chunk; the newest holds a block a store in flight pins (preempted, it frees
    nothing); the one before it holds a block of its own. Both are preempted and the
    oldest runs its whole chunk.
    Mutation: one preemption only (`if` for `while`): the scheduler then preempted the
    oldest request though it was not last (its assertion failed)."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=5))
    oldest = running(llm, list(range(12)), 8)
    middle = running(llm, list(range(20, 25)), 4)
    newest = running(llm, list(range(30, 35)), 4)
    llm.pool.pin(newest.block_tables[0])
    assert llm.pool.num_free() == 0
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(oldest, 4)]
    assert step.preempted_ids == {middle.request_id, newest.request_id}
    assert llm.scheduler.running == [oldest]
    assert list(llm.scheduler.waiting) == [middle, newest]
    assert middle.block_tables == newest.block_tables == [[]]


def test_the_last_running_request_short_of_blocks_a_load_holds_is_preempted() -> None:
    """Full attention, 4 usable blocks: the only running request needs a block, and a
    request loading its hit holds the other two (not a transfer alone: no frees pending,
    and the running one does not hold the pool). It is preempted, its blocks freed, and
    admitted again from token 0 with the chunk that fits (as vLLM preempts the last
    running request); it is never left running without work.
    Mutation: it stayed running, without work and without a preemption."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=5))
    alone = running(llm, list(range(9)), 8)
    loader = llm.add_request(list(range(40, 49)), ONE)
    llm.scheduler.waiting.remove(loader)
    placed(llm, loader, 8, llm.pool.allocate(2))
    loader.status = RequestStatus.WAITING_FOR_LOAD
    llm.scheduler.loading[loader.request_id] = loader
    assert llm.pool.num_free() == 0
    step = llm.scheduler.schedule()
    assert step.stuck is None
    assert not step.waits_for_frees
    assert step.preempted_ids == {alone.request_id}
    assert step.released_ids == set()
    assert llm.scheduler.num_preemptions == 1
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(alone, 8)]
    assert step.work[0].table_update is TableUpdate.REPLACE
    assert alone.num_computed_tokens == 0  # recomputed from scratch
    assert llm.scheduler.running == [alone]


class TierWithHit:
    """An offload side whose tiers hold `num_tokens` past any local prefix; it records
    the cap of each lookup and the external tokens each allocation accepted."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.caps: list[int | None] = []
        self.accepted: list[int] = []

    def lookup(self, request: Request, num_local_tokens: int, max_tokens: int | None = None) -> int:
        self.caps.append(max_tokens)
        return self.num_tokens if max_tokens is None else min(max_tokens, self.num_tokens)

    def on_allocated(self, request: Request, tables: object, num_external_tokens: int) -> None:
        self.accepted.append(num_external_tokens)


def test_a_request_whose_load_failed_never_asks_the_tier_again() -> None:
    """A failed load rewinds its request with `skip_external`: it recomputes, and every
    later admission (after a preemption, say: the offload side's own refusal, its
    `recompute_next`, lasts only until the request is allocated again) asks the tier for
    nothing, though the tier has a hit. A request without it takes the hit.
    Mutation: `cap = None` for a request with `skip_external` (it was admitted to load
    the 8 tokens again, WAITING_FOR_LOAD)."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=9))
    tier = TierWithHit(8)
    llm.scheduler.offload = tier  # type: ignore[assignment]
    failed = llm.add_request(list(range(13)), ONE)
    failed.skip_external = True  # as `rewind` leaves it
    fresh = llm.add_request(list(range(20, 33)), ONE)
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(failed, 13)]
    assert (failed.status, failed.num_external_tokens_total) == (RequestStatus.RUNNING, 0)
    assert (fresh.status, fresh.num_external_tokens_total) == (RequestStatus.WAITING_FOR_LOAD, 8)
    assert (tier.caps, tier.accepted) == ([0, None], [0, 8])
