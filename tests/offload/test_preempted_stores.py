"""Eager mode: a preempted request's blocks of its last step are stored before its table
goes (`offload/preempted_stores.py`), and only those its forwards wrote."""

from __future__ import annotations

import pytest
from sim import SimEngine, block_key
from sim_request import config, full_layout, make_request

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode
from kvtier.offload.preempted_stores import forget_last_step


def engine_with(num_tokens: int, num_gpu_blocks: int = 16) -> SimEngine:
    layout, eager = full_layout(), config(store_mode=StoreMode.EAGER)
    engine = SimEngine(layout, eager, num_gpu_blocks=num_gpu_blocks)
    engine.admit(make_request("r", range(num_tokens)))
    return engine


def tier_hit(engine: SimEngine, num_tokens: int) -> int:
    """Return the tier's hit for a request of the same prompt, the GPU cache emptied."""
    engine.evict_gpu()
    return engine.lookup(make_request("s", range(num_tokens))).num_offered_tokens


def test_a_preempted_requests_last_step_is_stored() -> None:
    # Regression: its table was reset before selection, so tokens 8-16 (computed in the
    # step before the preemption, confirmed only in the step that preempted it) never
    # reached the tier: the later request's hit was 8 tokens, not 16.
    engine = engine_with(20)
    engine.schedule("r", 8)
    engine.step()
    engine.schedule("r", 8)
    engine.step()  # selects tokens 0-8; computes 8-16
    engine.preempt("r")
    stored = {b for job in engine.step().jobs for b in job.src_block_ids}
    assert len(stored) == 2
    assert tier_hit(engine, 20) == 16
    engine.check()


@pytest.mark.parametrize("num_taken", [0, 1, 2], ids=["free", "tail_taken", "two_taken"])
def test_a_block_given_to_another_request_since_is_not_stored(num_taken: int) -> None:
    """Freed at the preemption, its blocks may go to another request in the same step
    (vLLM's preemptor), which gives them its own keys as it schedules them, before its
    forward writes them: the walk stops at the first block not under the request's key,
    and stores nothing past it (two taken: a mutant that walked on past the first cut
    the table at the second, and copied the first, unwritten, under the taker's key)."""
    engine = engine_with(17, num_gpu_blocks=5)  # r's 4 blocks, no other free one
    engine.schedule("r", 16)
    engine.step()  # computes 0-16: nothing selected yet
    table = list(engine.tables["r"][0])
    engine.preempt("r")
    if num_taken:  # the preemptor takes the blocks freed first (the tail first), hashes them
        q = make_request("q", range(100, 100 + 4 * num_taken))
        engine.admit(q)
        engine.schedule("q", 4 * num_taken)
        taken = engine.tables["q"][0]
        assert taken == table[::-1][:num_taken]
        for pos, block_id in enumerate(taken):  # as vLLM
            engine.gpu.insert_key(block_key(engine.layout, q, 0, pos), block_id, 4)
    stored = [b for job in engine.step().jobs for b in job.src_block_ids]
    assert stored == table[: len(table) - num_taken]
    engine.check()


def test_with_the_token_check_a_preemption_stores_nothing_of_its_last_step() -> None:
    """The token check notes each GPU block's fill as the scheduled requests take their
    blocks; a preempted request's blocks may be another's by then, so its last step is
    not stored (`select_preempted`): the later request hits only what the step before it
    stored (a mutant walked it as without the check: a hit of 16 tokens)."""
    layout, checked = full_layout(), config(store_mode=StoreMode.EAGER, token_check=True)
    engine = SimEngine(layout, checked, num_gpu_blocks=16)
    engine.admit(make_request("r", range(20)))
    engine.schedule("r", 8)
    engine.step()
    engine.schedule("r", 8)
    engine.step()  # selects tokens 0-8; computes 8-16
    engine.preempt("r")
    assert not engine.step().jobs
    assert tier_hit(engine, 20) == 8
    engine.check()


def test_nothing_is_stored_after_a_failed_load_of_its_last_step() -> None:
    """vLLM's recompute policy keeps a failed load's blocks (and those its step computed
    on them) cached under their keys and counts fewer tokens computed: where that step
    ended no longer bounds what is written (`Scheduler.apply_report` forgets it)."""
    engine = engine_with(20)
    engine.schedule("r", 8)
    engine.step()
    engine.schedule("r", 8)
    engine.step()
    forget_last_step(engine.scheduler.selector, ["r"])  # as a failed load's report does
    engine.preempt("r")
    assert not engine.step().jobs
    engine.check()


def test_tokens_counted_computed_ahead_are_not_counted_twice() -> None:
    """Regression (found by test_scheduler_stateful's write-back machine): with its
    step's tokens counted computed ahead of the forward (output placeholders), the end
    of a request's last step was noted as computed + scheduled, counting them twice.
    Preempted, its walk went past what its forward wrote, onto a block the same-prompt
    request that took it had keyed ahead of writing it: the store copied it unwritten
    (the fake worker: 'event 1: a source block changed while the copy was in flight')."""
    engine = engine_with(16)  # 4 tokens a block
    engine.schedule("r", 6)
    engine.count_ahead("r")
    engine.step()  # computes 0-6: block 1 half written
    (table,) = engine.tables["r"]
    engine.preempt("r")
    assert engine.admit(make_request("s", range(16))).num_local_tokens == 4
    engine.schedule("s", 4)
    assert engine.tables["s"][0][1] == table[1]  # r's half-written block, taken again
    engine.count_ahead("s")  # keyed under r's key at that position, not yet written
    stored = {b for job in engine.step().jobs for b in job.src_block_ids}
    assert table[1] not in stored
    engine.check()


def test_a_block_a_full_tier_leaves_of_a_preemption_counts_as_dropped() -> None:
    """The preemption's stores are its last (its table goes): a block the tier has no
    slot for is never retried, so it counts as dropped, not deferred (SPEC §6.10)."""
    layout, eager = full_layout(), config(store_mode=StoreMode.EAGER)
    engine = SimEngine(layout, eager, num_gpu_blocks=16, num_tier_blocks=4)  # 3 slots
    engine.auto_complete = False  # the first step's stores keep their slots
    engine.admit(make_request("r", range(20)))
    engine.schedule("r", 8)
    engine.step()
    engine.schedule("r", 8)
    engine.step()  # stores tokens 0-8 (2 slots); computes 8-16
    engine.scheduler.take_stats()
    engine.preempt("r")
    (store,) = engine.step().jobs
    assert len(store.src_block_ids) == 1  # the last slot
    outcomes = engine.scheduler.take_stats().store_outcomes
    assert outcomes == {"stored": 1, "dropped_tier_full": 1}
    engine.worker.complete_all()
    engine.drain()
    engine.check()


def test_a_preempted_requests_rejected_drafts_are_not_walked() -> None:
    """Its last step scheduled its last token (12) and 3 draft tokens (speculative
    decoding), all rejected: the step ends at 16, a block boundary its tokens do not
    reach (14). The preemption's walk ends at its last token: the drafts' block has no key
    and counts no store outcome (through vLLM: test_vllm_preempted_stores.py)."""
    # Mutation check: without the bound by the last token, the walk reached block 3
    # (tokens 12-15): {'dropped_unhashed': 1}.
    engine = SimEngine(full_layout(), config(store_mode=StoreMode.EAGER), num_gpu_blocks=16)
    request = make_request("r", range(12), outputs=[100, 101, 102])
    engine.admit(request)
    engine.schedule("r")
    engine.step()  # computes 0-12, samples token 12
    engine.schedule_drafts("r", 3, num_accepted=0)
    (store,) = engine.step().jobs
    assert len(store.src_block_ids) == 3  # blocks 0-2, confirmed
    assert (request.num_tokens, request.num_computed_tokens) == (14, 13)
    engine.scheduler.take_stats()
    engine.preempt("r")
    assert not engine.step().jobs
    assert engine.scheduler.take_stats().store_outcomes == {}
    engine.check()


def test_a_window_block_reused_before_the_cursor_does_not_stop_the_walk() -> None:
    """A sliding window frees blocks the request no longer reads, after they were stored
    (behind its cursor); the engine may give them to anyone, who re-keys them. Preempted,
    the request's walk starts at its cursors, so its last step's window blocks are stored
    all the same (a mutant walked from position 0: the evicted block cut the window's
    table there, and its last step's window blocks were lost)."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4),
        )
    )
    engine = SimEngine(layout, config(store_mode=StoreMode.EAGER), num_gpu_blocks=24)
    engine.admit(make_request("r", range(20)))
    engine.schedule("r", 8)
    engine.step()
    engine.schedule("r", 8)
    engine.step()  # stores tokens 0-8 of both groups; computes 8-16
    full, window = (list(table) for table in engine.tables["r"])
    engine.drop_blocks("r", 1, [0, 1])  # out of the window: freed, stored already
    engine.evict_gpu()  # reused: they lose their keys
    assert engine.gpu.key(window[0]) is None
    engine.preempt("r")
    stored = {b for job in engine.step().jobs for b in job.src_block_ids}
    assert stored == {*full[2:4], *window[2:4]}
    engine.check()


def test_a_window_null_the_walk_reaches_is_recovered_not_an_end() -> None:
    """b's GPU hit of 16 tokens leaves its window's positions 0-2 null (SPEC §6.5: a null
    slot is recovered from the GPU cache by its key). A full tier (c's stores in flight)
    holds both cursors at 0 in b's step; the stores complete, then b is preempted: its
    walk passes the nulls, and a's cached window blocks are stored with its full blocks
    (a mutant took a null for a block given away: the window's walk ended at position 0)."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4),
        )
    )
    eager = config(store_mode=StoreMode.EAGER)
    engine = SimEngine(layout, eager, num_gpu_blocks=64, num_tier_blocks=9)  # 8 slots
    engine.auto_complete = False
    engine.run(make_request("c", range(100, 133)))  # fills the tier
    engine.run(make_request("a", range(16)))  # stores nothing: its blocks stay GPU-cached
    b = make_request("b", range(21))
    assert engine.admit(b).num_local_tokens == 16
    assert engine.tables["b"][1][:3] == [NULL_BLOCK_ID] * 3
    engine.schedule("b", 4)
    full = list(engine.tables["b"][0])  # 5 blocks: the hit's 4, then tokens 16-20
    assert not engine.step().jobs  # the tier is full: both cursors stay at 0
    engine.worker.complete_all()
    engine.poll()
    engine.preempt("b")
    (store,) = engine.step().jobs
    recovered = [engine.gpu.cached_block(block_key(layout, b, 1, pos)) for pos in range(3)]
    assert store.src_block_ids == (*full, *recovered)  # 8 slots: the rest is dropped
    engine.check()


def test_a_preemption_stores_whole_scheduler_blocks_only() -> None:
    """SPEC §6.5: confirmed tokens are rounded down to the scheduler block (8 tokens: the
    groups' blocks are 8 and 4) before any is stored, so every group stores the same
    span. r's last step wrote tokens 0-12; preempted, it stores tokens 0-8 of both
    groups, as the step's own selection would have (a mutant did not round: it stored
    the 4-token group's block of tokens 8-12 too, past the span the other group stores)."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 8, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 64),
        )
    )
    engine = SimEngine(layout, config(store_mode=StoreMode.EAGER), num_gpu_blocks=24)
    engine.admit(make_request("r", range(20)))
    engine.schedule("r", 12)
    engine.step()  # computes 0-12: nothing confirmed before it
    full, window = (list(table) for table in engine.tables["r"])
    engine.preempt("r")
    stored = [b for job in engine.step().jobs for b in job.src_block_ids]
    assert stored == [full[0], *window[:2]]
    engine.check()
