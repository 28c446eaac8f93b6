"""`drain` against workers that report late, within its contract: it flushes the worker
after a step without progress, and counts steps without progress only in a row (a
report, an issued transfer, a computed token or a freed request's blocks is progress).
"""

from __future__ import annotations

from typing import Any

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import WorkerReport

ONE = SamplingParams(max_tokens=1, ignore_eos=True)
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=17)
TIER = OffloadConfig(cpu_bytes=4 << 20)


class ReportsAfterFlush:
    """Wrap a worker: nothing is reported until the engine flushes it (a worker that
    copies only when asked to finish); the poll after a flush reports everything."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.flushed = False
        self.passing = False

    def flush(self) -> None:
        self.worker.flush()
        self.flushed = True

    def peek(self) -> WorkerReport:
        self.passing = self.flushed
        return self.worker.peek() if self.passing else WorkerReport()

    def acknowledge(self) -> None:
        if self.passing:
            self.worker.acknowledge()
            self.flushed = self.passing = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


class OneAtATime:
    """Wrap a worker: a slow tier that reports one finished event every `gap` polls, the
    oldest first (each report is progress, `gap` is below drain's limit of 100)."""

    def __init__(self, worker: Any, gap: int) -> None:
        self.worker = worker
        self.gap = gap
        self.num_polls = 0
        self.held: dict[int, tuple[bool, int]] = {}  # event -> (done, count), in order
        self.returned: int | None = None

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        self.worker.acknowledge()  # kept here until handed on
        for event_id, count in report.done.items():
            self.held.setdefault(event_id, (True, count))
        for event_id, count in report.failed.items():
            self.held.setdefault(event_id, (False, count))
        self.num_polls += 1
        self.returned = None
        if self.num_polls % self.gap or not self.held:
            return WorkerReport()
        event_id = self.returned = next(iter(self.held))
        done, count = self.held[event_id]
        return (
            WorkerReport(done={event_id: count}) if done else WorkerReport(failed={event_id: count})
        )

    def acknowledge(self) -> None:
        if self.returned is not None:
            del self.held[self.returned]
            self.returned = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_drain_flushes_a_worker_that_reports_only_when_flushed() -> None:
    """Mutation: drain never flushed (it gave up after 100 steps, RuntimeError)."""
    llm = LLM(None, kv_offload=TIER, engine=ENGINE)
    assert llm.offload is not None
    llm.offload.worker = ReportsAfterFlush(llm.offload.worker)
    llm.generate([list(range(12))], ONE)
    assert llm.offload.has_pending_work()
    llm.drain()
    assert not llm.offload.has_pending_work()
    llm.shutdown()


def test_drain_counts_steps_without_progress_in_a_row_only() -> None:
    """Three requests' stores, reported one every 60 polls: no 100 steps in a row pass
    without a report, though 180 steps pass without anything else.
    Mutations: the count was not reset on progress; a report alone was not progress
    (both gave up with RuntimeError)."""
    llm = LLM(None, kv_offload=TIER, engine=ENGINE)
    assert llm.offload is not None
    llm.offload.worker = slow = OneAtATime(llm.offload.worker, gap=60)
    for start in (0, 20, 40):
        llm.generate([list(range(start, start + 12))], ONE)
    num_polls = slow.num_polls
    llm.drain()
    assert not llm.offload.has_pending_work()
    assert num_polls < 60 <= 180 <= slow.num_polls  # they came back one by one in drain
    llm.shutdown()
