"""What the connector's worker role hands vLLM each step: the requests whose loads
finished or failed (with the failures held for refused or skipped plans' events), the
suspect GPU blocks of failed loads vLLM keeps a prefix of, and the worker metadata for
the scheduler role (with the outputs vLLM dropped, sent again once: `redelivery`). None
of it is handed over while a forward's exception propagates: vLLM drops that output, and
the forward's plan step is remembered, so stores of plans built before the scheduler
role learned of the failure are reported failed."""

from __future__ import annotations

import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import replace

from kvtier.adapters.vllm.load_tracker import LoadTracker
from kvtier.adapters.vllm.metadata import KVTierWorkerMetadata
from kvtier.adapters.vllm.redelivery import Outbox, Output
from kvtier.offload.plan import WorkerReport
from kvtier.transfer.worker import OffloadWorker

# The worker role's logger: its warnings keep the name they are filtered and read by.
logger = logging.getLogger("kvtier.adapters.vllm.worker_side")


class WorkerResults(ABC):
    """Hand vLLM a rank's transfer results (a base of `WorkerSide`, which sets these up
    and provides `worker`).

    Thread affinity: the model runner's thread.
    """

    loads: LoadTracker
    outbox: Outbox
    _results_taken: bool
    _held_failures: WorkerReport
    _report: WorkerReport
    _echo_failed: tuple[str, ...]
    _output: Output
    _resend: Output | None
    _handed: frozenset[str]
    _last_step_id: int
    _plan_fault_step: int
    _failed_step: int | None

    @property
    @abstractmethod
    def worker(self) -> OffloadWorker:
        """Return the offload worker (`WorkerSide.worker`: raises before its KV caches
        are registered)."""

    @property
    def _stores_unsafe(self) -> bool:
        """Return True when a forward failed on this rank during a step the scheduler
        role had not learned of when it built the bound plan (`KVTierMetadata.fault_step`
        older than that step)."""
        return self._failed_step is not None and self._plan_fault_step < self._failed_step

    def _note_failed_step(self, step_id: int) -> None:
        """Remember that the forward of plan `step_id` failed (or never ran) here."""
        self._failed_step = max(step_id, self._failed_step or 0)

    def _note_failed_forward(self) -> bool:
        """Return True, and remember the bound plan's step, when vLLM calls the
        connector while an exception propagates: its model runner calls
        `get_transfer_results` and `build_connector_worker_meta` in a `finally` around
        the forward, and drops that step's output when the forward raised."""
        if sys.exc_info()[1] is None:
            return False
        self._note_failed_step(self._last_step_id)
        return True

    def _hold_failures(self, event_ids: Iterable[int]) -> None:
        """Report `event_ids` failed on this rank at the next `take_results`."""
        failed = dict.fromkeys(event_ids, 1)
        if failed:
            held = [self._held_failures, WorkerReport(failed=failed)]
            self._held_failures = WorkerReport.merge(held)

    def take_results(self) -> tuple[set[str], set[str]]:
        """Poll the worker; return (finished_recving, failed_recving) request ids.

        A request is finished once every load event listing it finished on this rank,
        and failed if any of them failed, unless every failure named its bad blocks
        and the layout takes errors by block: then it is only finished, and its
        suspect GPU blocks wait in `take_invalid_blocks`, which vLLM calls next in the
        same step. A failed request is also finished: vLLM releases it from waiting
        for its load.

        While the forward's exception propagates, nothing is polled: vLLM drops that
        step's output, and what finished is reported in the next step.
        """
        self._results_taken = True
        if self._note_failed_forward():
            return set(), set()
        report = self.worker.poll()
        if self._held_failures.failed:  # events of refused plans (`_fail_unsubmitted`)
            report = WorkerReport.merge([self._held_failures, report])
            self._held_failures = WorkerReport()
        finished, failed = self.loads.complete(report.done, report.failed, report.bad_blocks)
        unsplit = self.loads.unsplit  # failed whole here: whole for the scheduler too
        if unsplit:
            named = {e: b for e, b in report.bad_blocks.items() if e not in unsplit}
            report = replace(report, bad_blocks=named)
        self._report = WorkerReport.merge([self._report, report])
        if failed:
            logger.warning("kvtier loads failed for requests %s", sorted(failed))
        finished.update(self._echo_failed)
        failed.update(self._echo_failed)
        self._echo_failed = ()
        self._output = Output(
            self._last_step_id, WorkerReport(), frozenset(finished), frozenset(failed)
        )
        if self._resend is not None:  # outputs vLLM dropped: to vLLM again, exactly once
            finished.update(self._resend.finished_recving)
            failed.update(self._resend.failed_recving)
        self._handed = frozenset(finished)  # for the scheduler role to count (`recving`)
        return finished, failed

    def take_invalid_blocks(self) -> set[int]:
        """Return the suspect GPU blocks of the failed loads `take_results` reported as
        finished (vLLM keeps each request's tokens before its first one)."""
        invalid = self.loads.take_invalid_blocks()
        if invalid:
            self._output = replace(self._output, invalid_blocks=frozenset(invalid))
        if self._resend is not None and self._resend.invalid_blocks:
            invalid = invalid | self._resend.invalid_blocks
        return invalid

    def take_worker_metadata(self) -> KVTierWorkerMetadata | None:
        """Return what finished since the last call, and the step of a failed forward
        until a plan built after the scheduler role learned of it came, with the step of
        the last plan bound (an empty output too: the scheduler role's `processed_step`);
        None before any plan (or while the forward's exception propagates: vLLM would
        drop it)."""
        if self._note_failed_forward():
            return None
        failed_step = self._failed_step if self._stores_unsafe else None
        report, self._report = self._report, WorkerReport()
        output = replace(self._output, step_id=self._last_step_id, report=report)
        self._output = Output(self._last_step_id)
        sent = self.outbox.record(output)
        if self._resend is not None:
            report = WorkerReport.merge([report, self._resend.report])
            self._resend = None
        step_id = self._last_step_id
        handed, self._handed = self._handed, frozenset()
        if report.is_empty and failed_step is None and not sent and not step_id:
            return None  # no plan bound yet
        worker_id = self.outbox.worker_id
        steps = {worker_id: step_id} if step_id else {}
        recving = {worker_id: handed} if handed else {}
        return KVTierWorkerMetadata(report, failed_step, sent, steps, recving)
