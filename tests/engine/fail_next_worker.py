"""An offload worker wrapper for `test_llm_step_api_stateful`: it fails the next job on
demand and may finish plans within their step or hold its reports back (a slow tier).
"""

from __future__ import annotations

from typing import Any

from kvtier.engine.llm import LLM
from kvtier.offload.plan import TransferPlan, WorkerReport


class FailNext:
    """Wrap an offload worker: once armed, the next job submitted (with `loads_only`,
    the next load) is reported failed (though its copy ran); a failed load first
    scribbles over its GPU destination, so a scheduler that used those blocks anyway
    yields wrong tokens.

    With `synchronous`, every plan finishes within the step that submits it (reports do
    not depend on timing). With `slow` > 1, the worker's reports reach the engine at
    every `slow`-th poll only (a slow tier: `drain` then runs queued requests to their
    end), but at every poll after a flush, as its contract says.
    """

    def __init__(
        self, worker: Any, llm: LLM, synchronous: bool, slow: int, loads_only: bool = False
    ) -> None:
        self.worker = worker
        self.loads_only = loads_only
        self.kv_tensors = llm.runner.kv_tensors
        self.synchronous = synchronous
        self.slow = slow
        self.num_polls = 0
        self.flushed = False  # since the last submit: report everything
        self.armed = False
        self.doomed: dict[int, tuple[int, ...]] = {}  # event id -> load destinations
        self.num_failed = 0
        self.seen: WorkerReport | None = None  # what the worker's last `peek` returned

    def submit(self, plan: TransferPlan) -> None:
        jobs = [job for job in plan.jobs if job.is_load or not self.loads_only]
        if self.armed and jobs:
            job = jobs[0]
            self.doomed[job.event_id] = job.dst_block_ids if job.is_load else ()
            self.armed = False
        self.flushed = False
        self.worker.submit(plan)
        if self.synchronous:
            self.worker.flush()

    def flush(self) -> None:
        self.worker.flush()
        self.flushed = True

    def peek(self) -> WorkerReport:
        self.num_polls += 1
        if self.slow > 1 and not self.flushed and self.num_polls % self.slow:
            self.seen = None  # held back: the worker was not asked
            return WorkerReport()
        report = self.seen = self.worker.peek()
        done, failed = dict(report.done), dict(report.failed)
        seconds = dict(report.seconds)
        for event_id, dst in self.doomed.items():
            if event_id in done:
                failed[event_id] = done.pop(event_id)
                seconds.pop(event_id, None)
                for block_id in dst:
                    for layer in self.kv_tensors:
                        layer[:, block_id] = 1e3
        return WorkerReport(done=done, failed=failed, seconds=seconds, bad_blocks=report.bad_blocks)

    def acknowledge(self) -> None:
        # What the last `peek` returned, not a new `peek`: the worker forgets what it last
        # reported, and events finished since must be reported again.
        if self.seen is None:
            return
        reported = {*self.seen.done, *self.seen.failed}
        self.num_failed += len(reported & self.doomed.keys())
        for event_id in reported:
            self.doomed.pop(event_id, None)
        self.worker.acknowledge()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)
