"""A tier reset retried once per engine step, on the reference engine (SPEC §6.9; Beyond:
`offload.tier_reset`): it succeeds once the transfers outstanding at the first call drain.

The worker's reports are held back one poll (a legal asynchronous worker: `poll` never
blocks), so a copy planned in one step is still in flight at the next call, as on a
busy machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig, StoreMode
from kvtier.offload.plan import WorkerReport

MODEL = ModelConfig.tiny()
BLOCK_BYTES = MODEL.kv_bytes_per_token() * 4  # block size 4


class OnePollLate:
    """The engine's worker, its completions reported one poll after it made them."""

    def __init__(self, worker: Any) -> None:
        self.worker, self.held = worker, WorkerReport()

    def peek(self) -> WorkerReport:
        self.worker.flush()
        report, self.held = self.held, self.worker.peek()
        return report

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


@pytest.mark.parametrize("mode", ["lazy", "write_back"])
def test_a_reset_retried_every_step_succeeds_once_the_old_copies_drain(
    mode: str, tmp_path: Path
) -> None:
    # Regression: 200 retries all returned False. Lazy mode re-selected the GPU blocks
    # whose stores the last retry abandoned (never registered, so "not in the tier");
    # write-back demoted another block of the CPU tier each step.
    if mode == "lazy":
        config = OffloadConfig(
            cpu_bytes=8 * BLOCK_BYTES, store_mode=StoreMode.LAZY, max_batched_tokens=16
        )
        num_requests = 4
    else:
        config = OffloadConfig(
            cpu_bytes=4 * BLOCK_BYTES,
            disk_bytes=8 * BLOCK_BYTES,
            disk_path=str(tmp_path),
            cascade=CascadeMode.WRITE_BACK,
            disk_io_mode=DiskIOMode.PAGE_CACHE,
        )
        num_requests = 2
    llm = LLM(MODEL, config, EngineConfig(block_size=4, num_gpu_blocks=13))
    try:
        assert llm.offload is not None
        llm.offload.worker = OnePollLate(llm.offload.worker)  # type: ignore[assignment]
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        for i in range(num_requests):
            llm.generate([[i * 10 + t for t in range(12)]], params)
        if mode == "lazy":
            llm.step()  # its store is in flight at the first reset
        scheduler = llm.offload.scheduler
        num_steps = 0
        while not scheduler.reset():
            assert num_steps < 10, "reset still False after 10 steps"
            llm.step()
            num_steps += 1
        assert num_steps <= 2
        scheduler.check_invariants()
    finally:
        llm.shutdown()
