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


def placed(request: Request, num_computed: int, table: list[int]) -> Request:
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
    placed(request, num_computed, llm.pool.allocate(-(-num_computed // size)))
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
    placed(head, 12, [NULL_BLOCK_ID, *llm.pool.allocate(2)])
    store = pinned_block(llm)
    assert llm.pool.num_free() == 0
    assert llm.step() == []
    assert head.status is RequestStatus.WAITING
    assert llm.scheduler.waiting[0] is head
    # Its blocks stay: releasing them (as idle blocks of others) would only have it load
    # or compute them again. Mutation: the head released its own loaded blocks.
    assert head.block_tables[0][0] == NULL_BLOCK_ID
    assert (head.num_computed_tokens, llm.stats.num_idle_releases) == (12, 0)
    llm.pool.free([store])  # the store is reported
    assert llm.step() == [head]
    assert head.finish_reason is FinishReason.LENGTH
    llm.shutdown()


def back_from_load(llm: LLM, prompt: list[int], num_computed: int) -> Request:
    """Return a waiting request back from its load, holding its `num_computed` tokens."""
    request = llm.add_request(prompt, ONE)
    size = llm.engine_config.block_size
    return placed(request, num_computed, llm.pool.allocate(-(-num_computed // size)))


def test_a_running_request_short_of_blocks_takes_those_held_idle_by_waiting_ones() -> None:
    """Full attention, 4 usable blocks: the only running request needs a block; a waiting
    request back from its load holds the other two. Its idle blocks are freed (an idle
    release, not a preemption) and the running one goes on from its 8 tokens; a waiting
    request holding no blocks is not counted.
    Mutations: no idle release there (the running request preempted itself and ran
    again from token 0); a request without blocks counted as released."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=5))
    alone = running(llm, list(range(9)), 8)
    idle = back_from_load(llm, list(range(40, 49)), 8)
    blockless = llm.add_request(list(range(60, 63)), ONE)
    assert llm.pool.num_free() == 0
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(alone, 1)]
    assert alone.num_computed_tokens == 8
    assert step.released_ids == step.preempted_ids == {idle.request_id}
    assert (llm.scheduler.num_idle_releases, llm.scheduler.num_preemptions) == (1, 0)
    assert (idle.block_tables, idle.num_computed_tokens) == ([[]], 0)
    assert list(llm.scheduler.waiting) == [idle, blockless]


def test_a_head_that_does_not_fit_beside_running_ones_leaves_idle_blocks_alone() -> None:
    """Full attention, 5 usable blocks: a request runs (and grows into the last free
    block); the waiting head needs 3 blocks; behind it a request back from its load
    holds 2. While a request runs, blocks come back as it finishes: the idle ones are
    not released for the head.
    Mutation: released while others run (an idle release, its load wasted)."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=6))
    runner = running(llm, list(range(9)), 8)
    head = llm.add_request(list(range(20, 29)), ONE)
    idle = back_from_load(llm, list(range(40, 49)), 8)
    # (The head was preempted after `idle` came back from its load.)
    assert list(llm.scheduler.waiting) == [head, idle]
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(runner, 1)]
    assert step.preempted_ids == step.released_ids == set()
    assert (idle.num_computed_tokens, len(idle.block_tables[0])) == (8, 2)
    assert head.block_tables == [[]]


class FreesPending:
    """An offload side with a transfer holding a GPU block alone, and no tier hits."""

    def holds_gpu_blocks_alone(self) -> bool:
        return True

    def lookup(self, request: Request, num_local_tokens: int, max_tokens: int | None = None) -> int:
        return 0

    def on_allocated(self, request: Request, tables: object, num_external_tokens: int) -> None:
        pass


def test_nothing_is_admitted_while_a_running_request_waits_for_frees() -> None:
    """Full attention, 3 usable blocks: a running request needs 2 blocks for its next
    chunk, 1 is free and a transfer holds the other alone. It waits for it; a waiting
    request that would fit the free block is not admitted (it would take it).
    Mutation: admission went on (the waiting request ran, RUNNING)."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=4))
    llm.scheduler.offload = FreesPending()  # type: ignore[assignment]
    chunked = running(llm, list(range(12)), 4)
    pinned_block(llm)
    small = llm.add_request([1, 2, 3], ONE)
    assert llm.pool.num_free() == 1
    step = llm.scheduler.schedule()
    assert step.waits_for_frees
    assert (step.work, step.preempted_ids) == ([], set())
    assert (small.status, small.block_tables) == (RequestStatus.WAITING, [[]])
    assert llm.scheduler.running == [chunked]


def test_tables_are_sent_whole_once_then_appended() -> None:
    """A request's first work carries its whole tables; once `complete` applied it, the
    next work appends (its tables reached the offload side).
    Mutation: `complete` left `has_unconfirmed_work` set (every work sent whole)."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=5))
    request = llm.add_request(list(range(6)), SamplingParams(max_tokens=4, ignore_eos=True))
    updates = []
    for token in (7, 8, 9):
        step = llm.scheduler.schedule()
        updates.append([work.table_update for work in step.work])
        llm.scheduler.complete(step, [token], 0.0)
    assert updates == [[TableUpdate.REPLACE], [TableUpdate.APPEND], [TableUpdate.APPEND]]
    assert request.output_token_ids == [7, 8, 9]


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
    placed(loader, 8, llm.pool.allocate(2))
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


class NoFreesPending(FreesPending):
    """An offload side whose transfers hold no GPU block alone (and no tier hits)."""

    def holds_gpu_blocks_alone(self) -> bool:
        return False


def test_a_windowed_request_alone_short_of_a_block_a_store_holds_is_not_stuck() -> None:
    """Sliding-window layers only (window 8, blocks of 4), 3 usable blocks: the only
    running request holds the null block where its window left and blocks of its own; it
    needs one more. A waiting request back from its load holds the third, which a store in
    flight also reads. The idle block is released, the store keeps it: the running
    request does not hold the pool (the null block is none of its own), so it is
    preempted and admitted again with the chunk that fits, not taken for a request that
    never fits the pool (the engine aborts those, "no progress possible").
    Mutation: `_holds_the_pool` counted the null block as one of its own (step.stuck)."""
    model = dataclasses.replace(
        ModelConfig.tiny(),
        layer_kinds=(AttentionKind.SLIDING, AttentionKind.SLIDING),
        sliding_window=8,
    )
    llm = LLM(model, engine=EngineConfig(block_size=4, num_gpu_blocks=4))  # 3 usable
    llm.scheduler.offload = NoFreesPending()  # type: ignore[assignment]
    alone = placed(running(llm, list(range(13)), 0), 12, [NULL_BLOCK_ID, *llm.pool.allocate(2)])
    idle = back_from_load(llm, list(range(40, 49)), 4)
    llm.pool.pin(idle.block_tables[0])
    assert llm.pool.num_free() == 0
    step = llm.scheduler.schedule()
    assert step.stuck is None
    assert step.preempted_ids == {alone.request_id, idle.request_id}
    assert step.released_ids == {idle.request_id}
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(alone, 8)]
    assert (alone.num_computed_tokens, idle.block_tables) == (0, [[]])


def test_running_requests_past_the_token_budget_get_no_empty_work() -> None:
    """Batches of 2 tokens: three requests decode, one token each. The first two use the
    budget; the third gets no work this step (not a work of 0 tokens, which the model
    runner refuses).
    Mutation: the running loop went on at a budget of 0 (a third work, 0 tokens)."""
    llm = LLM(
        ModelConfig.tiny(),
        engine=EngineConfig(block_size=4, num_gpu_blocks=9, max_num_batched_tokens=2),
    )
    first, second, third = (running(llm, list(range(10 * i, 10 * i + 3)), 2) for i in range(3))
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(first, 1), (second, 1)]
    assert third.num_computed_tokens == 2
    assert llm.scheduler.running == [first, second, third]
