"""A request preempted in the step that scheduled it (vLLM's priority policy).

vLLM hashes a request's full blocks as it schedules them, before the forward writes
them. Under its priority policy a running request short of blocks preempts the
lowest-priority running one, even one scheduled earlier in the same `schedule()` call:
that one is dropped from the step and its blocks are freed with their keys, never
written. kvtier is told only that it was preempted. (Through vLLM's real scheduler:
tests/adapters/test_vllm_priority_victim.py.)
"""

from __future__ import annotations

import pytest
from sim import SimEngine, block_key
from sim_request import config, full_layout, make_request

from kvtier.offload.config import StoreMode


def victim_engine(mode: StoreMode) -> SimEngine:
    """A one-group engine under vLLM's priority policy (a step may preempt a request it
    scheduled), 16 GPU blocks, 16 tokens per step."""
    return SimEngine(
        full_layout(),
        config(store_mode=mode, max_batched_tokens=16),
        num_gpu_blocks=16,
        preempts_scheduled=True,
    )


def schedule_then_preempt(engine: SimEngine, request_id: str, num_tokens: int) -> set[int]:
    """Schedule `num_tokens` more tokens of the request, hash the blocks they fill (as
    vLLM's `allocate_slots` does), then preempt it in the same step, before any forward
    ran; return the GPU blocks hashed but never written."""
    start = engine.requests[request_id].num_computed_tokens
    engine.schedule(request_id, num_tokens)
    unwritten = engine.key_full_blocks(request_id, start, start + num_tokens)
    engine.preempt(request_id)
    return unwritten


@pytest.mark.parametrize(
    "written", [8, 6, 7], ids=["aligned", "partly_written_block", "one_token_short"]
)
@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_a_same_step_victims_unwritten_blocks_are_held_back(mode: StoreMode, written: int) -> None:
    """Regression (lazy): the walk over the GPU free queue copied the victim's blocks of
    the step it was dropped from into the tier, under their valid keys (the partly
    written block too, when the last chunk it ran ended inside one): KV never computed,
    served to any later hit, persisted by a disk tier. Eager mode never selects them
    from the victim's table (vLLM never sent them), but recovers a window's dropped
    position from vLLM's prefix cache by key: they are held out of that as a failed
    forward's blocks are (`StoreSelector.unconfirmed`). Eager mode stores the blocks of
    the victim's last completed step as it goes (`offload/preempted_stores.py`)."""
    engine = victim_engine(mode)
    engine.admit(make_request("r", range(33)))
    engine.schedule("r", written)
    engine.step()  # blocks 0 and 1 written (block 1 partly, unless aligned)
    partial = written % 4 != 0  # one token short: from a mutation check (end + 1)
    written_ids = set(engine.tables["r"][0][: 1 if partial else 2])
    unwritten = schedule_then_preempt(engine, "r", 16 - written)
    assert len(unwritten) == (3 if partial else 2)
    stored = {b for _ in range(4) for job in engine.step().jobs for b in job.src_block_ids}
    assert stored.isdisjoint(unwritten)
    assert written_ids <= stored  # what its forwards wrote is stored (eager: as it goes)
    if mode is StoreMode.EAGER:
        assert engine.scheduler.selector.unconfirmed == unwritten
    engine.check()


def test_blocks_another_request_holds_under_the_victims_keys_are_not_held_back() -> None:
    """Only free blocks are held back: a block in use under one of those keys was
    computed by its own request (two requests prefilling the same prompt at once)."""
    engine = victim_engine(StoreMode.LAZY)
    engine.admit(make_request("r", range(17)))
    engine.admit(make_request("s", range(17)))  # the same prompt; neither hits
    engine.schedule("r", 2)
    engine.schedule("s", 16)
    engine.step()
    computed = set(engine.tables["s"][0])
    unwritten = schedule_then_preempt(engine, "r", 14)
    engine.step()
    assert set(engine.scheduler.selector.lazy.held) == unwritten
    engine.finish("s")
    stored = {b for _ in range(4) for job in engine.step().jobs for b in job.src_block_ids}
    assert computed <= stored
    engine.check()


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_tokens_counted_computed_ahead_do_not_move_a_victims_unwritten_blocks(
    mode: StoreMode,
) -> None:
    """Regression: with its step's tokens counted computed ahead of the forward (output
    placeholders: the plan sees them computed), where a request's last scheduled step
    ends was noted as computed + scheduled, counting them twice (as eager's walk of a
    preempted request once did: test_preempted_stores.py). Preempted in the step that
    scheduled it again, the victim's unwritten blocks were looked for from that doubled
    end on: the walk (lazy) stored them, vLLM-style keyed and never written."""
    engine = victim_engine(mode)
    engine.admit(make_request("r", range(33)))
    engine.schedule("r", 6)
    engine.count_ahead("r")
    engine.step()  # computes 0-6: block 1 half written
    unwritten = schedule_then_preempt(engine, "r", 6)  # blocks 1 and 2, keyed
    assert len(unwritten) == 2
    stored = {b for _ in range(4) for job in engine.step().jobs for b in job.src_block_ids}
    assert stored.isdisjoint(unwritten)
    for block_id in unwritten:  # nor served as a hit by the engine
        assert engine.gpu.key(block_id) is None
    engine.check()


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_a_same_step_victims_rejected_draft_block_is_held_back(mode: StoreMode) -> None:
    """Its last step scheduled its last token (12) and 3 drafts, accepting 2 (speculative
    decoding): that step counts up to 16, but the KV of its bonus token (15) was never
    computed (a rejected draft's KV is there). Scheduled again, the block of tokens 12-15
    is full and hashed, then it is preempted in that step: what its forwards wrote ends
    at its last token, so that block is held back and its key dropped, and a request of
    the same tokens hits only blocks 0-2 (through vLLM:
    tests/adapters/test_vllm_priority_victim_drafts.py)."""
    # Mutation check: bounded by `num_tokens` (not `num_tokens - 1`), or not bounded
    # by the last token at all, the block kept its key: lazy stored it ('assert 4 not in
    # {1, 2, 3, 4}'), eager left it keyed for a local hit ('assert b'...' is None').
    engine = victim_engine(mode)
    request = make_request("r", range(12), outputs=range(100, 110))
    engine.admit(request)
    engine.schedule("r")
    engine.step()  # computes 0-12, samples token 12
    engine.schedule_drafts("r", 3, num_accepted=2)
    engine.step()  # computes 12-15, samples token 15
    assert (request.num_tokens, request.num_computed_tokens) == (16, 15)
    (block,) = schedule_then_preempt(engine, "r", 1)  # hashed as its bonus token is scheduled
    assert engine.gpu.key(block) == block_key(engine.layout, request, 0, 3)
    stored = {b for _ in range(4) for job in engine.step().jobs for b in job.src_block_ids}
    assert block not in stored
    assert engine.gpu.key(block) is None
    again = engine.admit(make_request("s", [*request.token_ids, 7]))
    assert again is not None
    assert again.num_local_tokens == 12
    engine.schedule("s")
    engine.step()  # reads every block it hit
    engine.check()


def test_a_finished_request_leaves_no_last_step_behind() -> None:
    """Where each request's last scheduled step ends is kept only while it may still be
    preempted: a finished request's entry (its view, token ids and all) goes with it,
    else every request a long-running engine served stayed referenced (a mutant that
    kept them left 3 entries here)."""
    engine = victim_engine(StoreMode.EAGER)
    for i in range(3):
        engine.run(make_request(f"r{i}", range(9)))
    engine.step()
    assert not engine.scheduler._plans._written
    engine.check()


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_a_victims_unwritten_blocks_of_two_hash_blocks_each_are_held_back(
    mode: StoreMode,
) -> None:
    """8-token blocks over 4-token hash blocks: a block's key is its last hash block's.
    The victim's unwritten blocks are found by those keys (a mutant looked them up by
    each block's first hash: it found none, and the lazy walk stored both, KV never
    computed)."""
    engine = SimEngine(
        full_layout(block_size=8, hash_block_size=4),
        config(store_mode=mode, max_batched_tokens=16),
        num_gpu_blocks=16,
        preempts_scheduled=True,
    )
    engine.admit(make_request("r", range(49)))
    engine.schedule("r", 16)
    engine.step()  # blocks 0 and 1 written
    unwritten = schedule_then_preempt(engine, "r", 16)
    assert len(unwritten) == 2
    stored = {b for _ in range(4) for job in engine.step().jobs for b in job.src_block_ids}
    assert stored.isdisjoint(unwritten)
    assert [engine.gpu.key(b) for b in unwritten] == [None, None]
    engine.check()


def test_the_search_for_unwritten_blocks_stops_at_the_last_hashed_block() -> None:
    """A short victim: the unwritten positions the search may look at (up to a step's
    tokens past what was written) run past its hashes; it stops at the first position
    not hashed yet (a mutant read one hash past the end: IndexError)."""
    engine = victim_engine(StoreMode.LAZY)
    engine.admit(make_request("r", range(17)))
    engine.schedule("r", 8)
    engine.step()
    unwritten = schedule_then_preempt(engine, "r", 8)
    assert len(unwritten) == 2
    stored = {b for _ in range(4) for job in engine.step().jobs for b in job.src_block_ids}
    assert stored.isdisjoint(unwritten)
    engine.check()
