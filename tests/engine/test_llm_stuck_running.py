"""A running request that outgrows the whole pool is aborted where it stands.

The up-front check (`validation.num_peak_blocks`) is bypassed, so a request admitted with
a short prompt decodes until it holds every block of the pool and needs one more. The
step finds it holding the pool alone (`BlockGrowth._holds_the_pool`) and aborts it, with
no preemption: preempting it would free its blocks only to recompute them again.
"""

from __future__ import annotations

import pytest
from step_watchdog import with_watchdog

from kvtier.engine import validation
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import RequestStatus
from kvtier.engine.sampling import FinishReason, SamplingParams


def step_until_done(llm: LLM) -> None:
    while llm.scheduler.has_unfinished():
        llm.step()


def test_a_running_request_holding_the_whole_pool_is_aborted_without_a_preemption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = EngineConfig(block_size=4, num_gpu_blocks=8)  # 7 usable blocks: 28 tokens
    llm = LLM(ModelConfig.tiny(), engine=engine)
    arm = with_watchdog(llm, 200)
    arm()
    monkeypatch.setattr(validation, "num_peak_blocks", lambda layout, num_tokens: 0)
    request = llm.add_request([1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
    # 28 tokens computed fill the 7 blocks; the 29th (sampled) needs an 8th.
    with pytest.raises(RuntimeError, match=r"no progress possible: req-0 \(29 tokens\)"):
        step_until_done(llm)
    assert (request.status, request.finish_reason) == (RequestStatus.FINISHED, FinishReason.ABORT)
    assert llm.stats.num_preemptions == 0
    assert llm.pool.num_free() == llm.pool.num_usable_blocks
    llm.shutdown()
