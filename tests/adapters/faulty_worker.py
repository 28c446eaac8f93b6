"""`FaultyWorker`: one rank's `OffloadWorker` with transfers started late, reported late
or failed, for `test_vllm_random_ops` (its driver `random_ops_driver.Run` makes one per rank).

Test helper only. Needs no vLLM: it wraps kvtier's worker, not the engine's.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvtier.offload.plan import TransferJob, TransferPlan, WorkerReport
from kvtier.transfer.worker import OffloadWorker

KINDS = ("load", "store", "move")  # move: a CPU -> DISK demotion (the cascade)


def job_kind(job: TransferJob) -> str:
    if job.is_load:
        return "load"
    return "store" if job.is_store else "move"


@dataclass
class _Job:
    start: int  # the poll at which it starts
    hold: int  # polls between its end and its report
    plan: TransferPlan  # this one job
    fail: bool
    fail_part: bool = False  # a load that runs, then one block of it reads as bad


class FaultyWorker:
    """Wrap one rank's `OffloadWorker`: run jobs late, report them late, fail some.

    `delay[kind]` polls pass between a job's submission and its start, `hold[kind]`
    between its end and its report. Each direction (loads; stores and moves: the
    worker's two lanes) starts and reports its jobs in submission order. Every poll
    first waits for the jobs started, so runs are deterministic. `fail[kind]` jobs of
    that kind from now on never run and are reported failed; a failed load also zeroes
    its GPU destination blocks (the copy half landed). `fail_part` loads from now on run,
    then report one source block bad (`WorkerReport.bad_blocks`, as a disk slot failing
    its checksum does) with its GPU destination zeroed. `flush` (vLLM preempted a
    request) starts every queued job and waits for it; reports may still be held.
    """

    def __init__(self, worker: OffloadWorker, scribble: Callable[[tuple[int, ...]], None]):
        self._submit, self._poll, self._flush = worker.submit, worker.poll, worker.flush
        self._scribble = scribble
        self.delay = dict.fromkeys(KINDS, 0)
        self.hold = dict.fromkeys(KINDS, 0)
        self.fail: collections.Counter[str] = collections.Counter()
        self.fail_part = 0
        self._bad: dict[int, tuple[int, int]] = {}  # event -> (bad source, its destination)
        self.num_failed: collections.Counter[str] = collections.Counter()
        self.num_run = 0
        self.num_late = 0  # jobs started or reported at least one poll late
        self._queues: dict[bool, list[_Job]] = {True: [], False: []}  # by is_load
        self._holds: dict[int, tuple[bool, int]] = {}  # running event -> direction, hold
        self._reports: dict[bool, list[tuple[int, int, bool]]] = {True: [], False: []}
        self._polls = 0
        worker.submit = self.submit  # type: ignore[method-assign]
        worker.poll = self.poll  # type: ignore[method-assign]
        worker.flush = self.flush  # type: ignore[method-assign]

    def submit(self, plan: TransferPlan) -> None:
        if plan.need_flush:
            self.flush()
        for job in plan.jobs:
            kind = job_kind(job)
            queue = self._queues[job.is_load]
            start = max(self._polls + self.delay[kind], queue[-1].start if queue else 0)
            fail = self.fail[kind] > 0
            self.fail[kind] -= fail
            part = not fail and job.is_load and self.fail_part > 0
            self.fail_part -= part
            self.num_late += start > self._polls or self.hold[kind] > 0
            queue.append(_Job(start, self.hold[kind], replace(plan, jobs=(job,)), fail, part))
        self._start(self._polls)

    def poll(self) -> WorkerReport:
        now = self._polls
        self._start(now)
        self._flush()
        ended = self._poll()
        outcomes = [(e, False) for e in ended.done] + [(e, True) for e in ended.failed]
        for event_id, failed in outcomes:
            is_load, hold = self._holds.pop(event_id)
            bad = self._bad.get(event_id)
            if bad is not None and failed:
                del self._bad[event_id]  # it really failed: whole
            elif bad is not None:
                self._scribble((bad[1],))
                failed = True
                self.num_failed["load_part"] += 1
            self._report_at(is_load, now + hold, event_id, failed)
        self._polls += 1
        done: dict[int, int] = {}
        failed_now: dict[int, int] = {}
        bad_blocks: dict[int, frozenset[int]] = {}
        for reports in self._reports.values():
            while reports and reports[0][0] <= now:
                _, event_id, failed = reports.pop(0)
                (failed_now if failed else done)[event_id] = 1
                bad = self._bad.pop(event_id, None)
                if bad is not None:
                    bad_blocks[event_id] = frozenset({bad[0]})
        return WorkerReport(done, failed_now, bad_blocks=bad_blocks)

    def flush(self) -> None:
        self._start(None)
        self._flush()

    def _start(self, now: int | None) -> None:
        for is_load, queue in self._queues.items():
            while queue and (now is None or queue[0].start <= now):
                item = queue.pop(0)
                (job,) = item.plan.jobs
                if not item.fail:
                    self._holds[job.event_id] = (is_load, item.hold)
                    if item.fail_part:  # a block past the first, where there is one
                        index = (job.event_id % 3 + 1) % len(job.src_block_ids)
                        self._bad[job.event_id] = (
                            job.src_block_ids[index],
                            job.dst_block_ids[index],
                        )
                    self._submit(replace(item.plan, need_flush=False))
                    self.num_run += 1
                    continue
                if job.is_load:
                    self._scribble(job.dst_block_ids)
                self._report_at(is_load, self._polls + item.hold, job.event_id, True)
                self.num_failed[job_kind(job)] += 1

    def _report_at(self, is_load: bool, poll: int, event_id: int, failed: bool) -> None:
        reports = self._reports[is_load]
        reports.append((max(poll, reports[-1][0] if reports else 0), event_id, failed))

    @property
    def is_idle(self) -> bool:
        return not any(self._queues.values()) and not any(self._reports.values())

    def copy_now(self, job: TransferJob) -> None:
        """Run `job` past kvtier (idle worker only): start it, wait, swallow its report."""
        assert self.is_idle
        self._submit(TransferPlan(step_id=0, jobs=(job,)))
        self._flush()
        report = self._poll()
        assert (report.done, report.failed) == ({job.event_id: 1}, {})
