"""A write-back cascade whose disk fails every write: `drain()` / `shutdown()` still end.

Regression: every CPU → DISK demotion failed, each failure reported one poll late (a legal
asynchronous worker). An idle engine issued and failed one demotion every step, and
`has_pending_work()` counted them, so it never turned False; since each step issued and
got reported an event, `drain()`'s stall detector never fired either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from step_watchdog import with_watchdog

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier, TransferPlan, WorkerReport

MAX_STEPS = 300  # a hang fails the test instead of blocking pytest


class DiskWritesFail:
    """Wrap a worker: every CPU → DISK job fails, reported one poll after it finished."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.moves: set[int] = set()
        self.late: dict[int, int] = {}

    def submit(self, plan: TransferPlan) -> None:
        self.moves |= {job.event_id for job in plan.jobs if job.dst_tier is Tier.DISK}
        self.worker.submit(plan)

    def peek(self) -> WorkerReport:
        self.worker.flush()
        report = self.worker.peek()
        done = {e: n for e, n in report.done.items() if e not in self.moves}
        failed = {**report.failed, **self.late}
        self.late = {e: n for e, n in report.done.items() if e in self.moves}
        return WorkerReport(done=done, failed=failed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def failing_write_back_engine(tmp_path: Path) -> LLM:
    """A tiny model's engine (24 GPU blocks of 4 tokens) over a write-back cascade of 8
    CPU and 16 disk blocks under `tmp_path`, whose disk fails every write."""
    model = ModelConfig.tiny()
    block_bytes = model.kv_bytes_per_token() * 4
    config = OffloadConfig(
        cpu_bytes=8 * block_bytes,
        disk_bytes=16 * block_bytes,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        cascade=CascadeMode.WRITE_BACK,
    )
    llm = LLM(model, config, EngineConfig(block_size=4, num_gpu_blocks=24))
    assert llm.offload is not None
    llm.offload.worker = DiskWritesFail(llm.offload.worker)
    return llm


def test_drain_ends_with_a_disk_that_fails_every_write_back_demotion(tmp_path: Path) -> None:
    llm = failing_write_back_engine(tmp_path)
    assert llm.offload is not None
    arm = with_watchdog(llm, MAX_STEPS)
    arm()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i in range(3):
        llm.generate([[(7 * i + t) % 128 for t in range(24)]], params)
    for _ in range(50):
        llm.step()
    cpu = llm.offload.scheduler.tier_pool
    num_cached = sum(cpu.key(b) is not None for b in cpu.iter_free_after(None))
    assert llm.offload.totals.num_failed_demotions <= num_cached + 2, "failed demotions retried"
    arm()
    llm.drain()
    assert not llm.offload.has_pending_work()
    llm.offload.scheduler.check_invariants()
    arm()
    llm.shutdown()
