"""The order in which the scheduler gives a request's GPU blocks back to the pool.

A request's blocks are freed tail first (`QueueRecovery._free_unfreed`): in the pool's
free queue its root then sits behind its tail and is evicted last, so a later request
with the same prefix still finds the start of it after a few evictions. Freed root first,
the first eviction took the root and every later block became unreachable (a prefix
hit needs the blocks before it)."""

from __future__ import annotations

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams

ONE = SamplingParams(max_tokens=1, ignore_eos=True)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]  # four full blocks of 4


def _hit_after_evictions(free_after: int) -> int:
    """Run PROMPT, then a request taking all but its blocks plus `free_after` more,
    then PROMPT again; return the second run's prefix hit tokens."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=8)
    with LLM(None, engine=engine) as llm:
        (first,) = llm.generate([PROMPT], ONE)
        assert first.num_cached_tokens == 0
        free = llm.scheduler.pool.num_free()  # PROMPT's 4 cached blocks among them
        other = [100 + i for i in range(4 * (free - 4 + free_after))]
        llm.generate([other], ONE)
        (again,) = llm.generate([[*PROMPT, 7]], ONE)
        return again.num_local_hit_tokens


def test_a_finished_requests_blocks_are_evicted_tail_first() -> None:
    assert _hit_after_evictions(0) == 16  # nothing of PROMPT evicted
    assert _hit_after_evictions(1) == 12  # its tail block went first, not its root
    assert _hit_after_evictions(2) == 8
