"""A same-step victim's unwritten blocks taken again by a prefix hit (vLLM's priority policy).

vLLM leaves a same-step victim's never-written blocks cached under their keys
(tests/adapters/test_vllm_priority_victim.py) and serves them as local prefix hits: to
the victim itself when it resumes, or to a request with the same prompt. A hit reads a
block, it writes nothing: the block still holds KV never computed, and kvtier must keep
it out of the tier after the hit as before it. (kvtier drops those blocks' keys from the
engine's pool, so vLLM serves none of them: `keep_unwritten_keys` plays an engine that
keeps them, for the guard behind that.)
"""

from __future__ import annotations

import pytest
from sim import SimEngine, keep_unwritten_keys
from sim_request import make_request
from test_same_step_preemption import schedule_then_preempt, victim_engine

from kvtier.offload.config import StoreMode


def serve_cached_blocks(engine: SimEngine) -> None:
    """Let local hits take any block cached under a key, written or not, and the forward
    read them, as vLLM does (the sim's own checks refuse both)."""
    engine.cached_block = engine.gpu.cached_block  # type: ignore[method-assign]
    engine.check_kv = lambda request: None  # type: ignore[method-assign]


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_unwritten_blocks_taken_by_a_prefix_hit_stay_out_of_the_tier(mode: StoreMode) -> None:
    """Regression (lazy): the hit's allocation noted the held blocks in use, which
    released them; freed again, the walk copied them into the tier under their keys
    (stored blocks {1, 2, 3, 4, 5}, unwritten {3, 4}). Eager: the hit's table dropped
    them from `unconfirmed` and was selected from position 0 (the same sets)."""
    engine = victim_engine(mode)
    keep_unwritten_keys(engine)
    engine.admit(make_request("r", range(33)))
    engine.schedule("r", 8)
    engine.step()  # blocks 0 and 1 written
    unwritten = schedule_then_preempt(engine, "r", 8)
    assert len(unwritten) == 2
    stored = {b for job in engine.step().jobs for b in job.src_block_ids}
    serve_cached_blocks(engine)
    hit = engine.admit(make_request("s", range(33)))  # the same prompt
    assert hit is not None
    assert hit.num_local_tokens == 16
    assert unwritten <= set(engine.tables["s"][0])
    engine.schedule("s", 4)  # vLLM runs it on from its hit (reading KV never written)
    stored |= {b for job in engine.step().jobs for b in job.src_block_ids}
    engine.finish("s")
    stored |= {b for _ in range(4) for job in engine.step().jobs for b in job.src_block_ids}
    assert stored.isdisjoint(unwritten)
    engine.check()
