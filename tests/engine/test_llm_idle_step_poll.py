"""An idle step (nothing to compute, a load in flight) waits a moment for the transfers,
then polls: a load that finished during the wait is applied by that step.

Regression: the step polled first and waited after, so a load finished during the wait
was only seen by the next step (one more idle step per load, each a wait).
"""

from __future__ import annotations

import time
import types

import pytest

import kvtier.engine.llm as llm_module
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

MODEL = ModelConfig.tiny()
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=13)  # 12 usable blocks
ONE = SamplingParams(max_tokens=1, ignore_eos=True)
P = list(range(16))  # 4 blocks, stored to the tier
EVICT = list(range(40, 85))  # 12 blocks: push P out of the GPU cache


def test_a_load_finished_during_the_idle_wait_is_applied_by_that_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    offload = OffloadConfig(cpu_bytes=64 * ENGINE.block_size * MODEL.kv_bytes_per_token())
    with LLM(MODEL, offload, ENGINE) as llm:
        for prompt in ([*P, 99, 98, 97, 96], EVICT):
            llm.generate([prompt], ONE)
            llm.drain()
        assert llm.offload is not None
        worker = llm.offload.worker
        waits: list[float] = []

        def wait_for_the_worker(seconds: float) -> None:
            waits.append(seconds)
            worker.flush()  # the load finishes during the idle wait

        clock = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=wait_for_the_worker)
        monkeypatch.setattr(llm_module, "time", clock)
        hit = llm.add_request([*P, 1, 2], ONE)
        assert llm.step() == []  # admits the hit, loads it, computes nothing
        assert len(waits) == 1
        assert hit.num_external_tokens_total == 16
        assert hit.status is RequestStatus.WAITING  # was WAITING_FOR_LOAD, for one more step
        assert llm.step() == [hit]
