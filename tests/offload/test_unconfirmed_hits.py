"""Eager mode: which blocks of unconfirmed compute a scheduled request takes again
(`offload/unconfirmed_hits.py`).

A same-step victim's blocks (vLLM's priority policy) are keyed but never written. A
prefix hit that reads one of them writes nothing: none of the hit's blocks is stored from
that request's table. A block a request writes anew (its resumed table past the hit, or a
block appended to a running one) leaves the set.
"""

from __future__ import annotations

import pytest
from sim import SimEngine, keep_unwritten_keys
from sim_request import make_request
from test_same_step_preemption import schedule_then_preempt, victim_engine
from test_same_step_victim_hits import serve_cached_blocks

from kvtier.offload.config import StoreMode


def stored_blocks(engine: SimEngine, num_steps: int = 1) -> set[int]:
    """Step `num_steps` times; return the GPU blocks the plans store."""
    return {b for _ in range(num_steps) for job in engine.step().jobs for b in job.src_block_ids}


def test_a_hit_whose_last_block_alone_is_unwritten_stores_none_of_its_blocks() -> None:
    """The victim wrote blocks 0-2 and was dropped from the step that keyed block 3: a
    request with the same prompt hits all four locally (an engine serving unwritten
    blocks). Only the hit's last block is unwritten: it must still be found, else the
    hit's table is stored from position 0 and block 3 (KV never computed) reaches the
    tier under its key (a mutant checking `ids[:num_hit - 1]` stored it)."""
    engine = victim_engine(StoreMode.EAGER)
    keep_unwritten_keys(engine)
    engine.admit(make_request("r", range(33)))
    engine.schedule("r", 12)
    engine.step()  # blocks 0-2 written
    unwritten = schedule_then_preempt(engine, "r", 4)
    assert len(unwritten) == 1
    stored = stored_blocks(engine)
    assert engine.scheduler.selector.unconfirmed == unwritten
    serve_cached_blocks(engine)
    hit = engine.admit(make_request("s", range(33)))
    assert hit is not None
    assert hit.num_local_tokens == 16
    engine.schedule("s", 4)
    stored |= stored_blocks(engine)
    engine.finish("s")
    stored |= stored_blocks(engine, 4)
    assert stored.isdisjoint(unwritten)
    engine.check()


@pytest.mark.parametrize("taken_by", ["resumed_victim", "running_request"])
def test_blocks_written_anew_leave_the_unconfirmed_set(taken_by: str) -> None:
    """The victim's unwritten blocks lose their keys and go to the head of the GPU free
    queue: the next allocation takes them to write them. Taken by the victim's resumed
    table past its hit (a replaced table) or appended to a running request, they hold
    written KV from then on and leave `unconfirmed` (mutants that kept either stayed
    with {3, 4} in the set)."""
    engine = victim_engine(StoreMode.EAGER)
    engine.admit(make_request("q", range(100, 140)))
    engine.schedule("q", 4)
    engine.admit(make_request("r", range(33)))
    engine.schedule("r", 8)
    engine.step()  # q's block 0, r's blocks 0 and 1 written
    unwritten = schedule_then_preempt(engine, "r", 8)
    engine.step()
    assert engine.scheduler.selector.unconfirmed == unwritten
    if taken_by == "resumed_victim":
        admission = engine.admit(make_request("r", range(33)))
        assert admission is not None
        assert admission.num_local_tokens == 8
        engine.schedule("r", 8)
        taken = set(engine.tables["r"][0][2:4])
    else:
        engine.schedule("q", 8)
        taken = set(engine.tables["q"][0][1:3])
    assert taken == unwritten  # reused first: unhashed once their keys went
    engine.step()
    assert not engine.scheduler.selector.unconfirmed
    engine.check()
