"""A running request short of GPU blocks that transfers hold alone waits for them rather
than preempting a request (`Scheduler._frees_pending`, vLLM's `has_pending_block_frees`).

A finished request's stores (eager) or the lazy walk's (lazy) pin its blocks until the
worker reports them; a gate holds those reports back, so the blocks stay pinned while
two requests decode into a pool that has room for one more block. The engine waits,
preempts nothing, and once the reports arrive serves what an engine without offloading
serves; with the check switched off, the same run preempts.
"""

from __future__ import annotations

import pytest
from held_reports import GatedReports

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig, StoreMode

MIB = 1 << 20
# The first request's 6 blocks + 2 prompt blocks each for the next two + 1 to grow into
# (plus the null block).
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=64)
FIRST = list(range(100, 124))
NEXT = [list(range(10, 18)), list(range(30, 38))]
ONE = SamplingParams(max_tokens=1, ignore_eos=True)
DECODE = SamplingParams(max_tokens=10, ignore_eos=True)


def served(llm: LLM, gate: GatedReports | None) -> list[tuple[int, ...]]:
    """Serve FIRST, then NEXT by steps (the gate closed for 12 steps); return NEXT's tokens."""
    llm.generate([FIRST], ONE)
    requests = [llm.add_request(prompt, DECODE) for prompt in NEXT]
    for _ in range(12):
        llm.step()
    if gate is not None:
        gate.opened = True
    for _ in range(200):
        if not llm.scheduler.has_unfinished():
            break
        llm.step()
    assert not llm.scheduler.has_unfinished()
    return [tuple(r.output_token_ids) for r in requests]


def gated_engine(mode: StoreMode) -> tuple[LLM, GatedReports]:
    llm = LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB, store_mode=mode), engine=ENGINE)
    assert llm.offload is not None
    gate = GatedReports(llm.offload.worker)
    llm.offload.worker = gate
    return llm, gate


@pytest.mark.parametrize("mode", list(StoreMode))
def test_a_request_short_of_blocks_waits_for_the_stores_to_free_them(mode: StoreMode) -> None:
    expected = served(LLM(None, engine=ENGINE), None)
    llm, gate = gated_engine(mode)
    with llm:
        assert served(llm, gate) == expected
        assert llm.stats.num_preemptions == 0
        assert llm.stats.num_waits_for_frees > 0


def test_without_the_wait_the_same_run_preempts() -> None:
    """The test above can fail: switched off, the check's absence shows as preemptions."""
    llm, gate = gated_engine(StoreMode.EAGER)
    llm.scheduler._frees_pending = lambda: False  # type: ignore[method-assign]
    with llm:
        served(llm, gate)
        assert llm.stats.num_preemptions > 0
        assert llm.stats.num_waits_for_frees == 0
