"""Worker outputs vLLM dropped, sent again exactly once.

Under vLLM's fault tolerance (`enable_fault_tolerance`) a rank that raises after its
connector calls of the step returned (computing logits, sampling: after
`build_connector_worker_meta`) has that step's whole output dropped: the transfer events
it reported done or failed, and the requests whose loads it finished, never reach the
scheduler. Unrepaired, those events keep their pins, vLLM keeps waiting for those loads,
and the engine never goes idle. (The other ranks' outputs of that step reach the
scheduler with the next step's, and a forward that raised inside the connector calls is
handled where it is seen: `WorkerSide`.)

So every output with something in it gets a number (per worker, from 1), kept by the
worker until the scheduler role acknowledges it: each plan carries the numbers it has
applied per worker (`Receipts.acks`) and the newest step whose outputs of every worker
it applied (`Receipts.processed_step`). vLLM applies each rank's outputs in step order
(a rank's output of a step together with the others', salvaged with the next step's, or,
when another rank's forward raised, alone): once the scheduler has applied every
worker's output of step `s` or later, an unacknowledged output of step `s` was dropped,
never delayed. The worker then sends its contents again (`Outbox`);
until it is acknowledged the worker puts an entry in every output, even an empty one,
so that the scheduler learns which steps it has applied.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from kvtier.offload.plan import WorkerReport

logger = logging.getLogger(__name__)

# worker id -> (step id of the plan bound when the output was built, output numbers in it)
Sent = Mapping[int, tuple[int, tuple[int, ...]]]
# worker id -> (every number up to this one applied, the numbers applied above it)
Acks = Mapping[int, tuple[int, tuple[int, ...]]]


@dataclass(frozen=True)
class Output:
    """What one output of a worker carried to vLLM, or one sent again."""

    step_id: int
    report: WorkerReport = field(default_factory=WorkerReport)
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_blocks: frozenset[int] = frozenset()

    @property
    def is_empty(self) -> bool:
        """Return True when the output carried nothing to the scheduler or to vLLM."""
        return (
            self.report.is_empty
            and not self.finished_recving
            and not self.failed_recving
            and not self.invalid_blocks
        )


def merge_sent(a: Sent, b: Sent) -> Sent:
    """Return both workers' entries; one worker's twice (a salvaged output with the next
    step's) keeps the later step and every number."""
    if not b:
        return a
    if not a:
        return b
    merged = dict(a)
    for worker_id, (step_id, numbers) in b.items():
        if worker_id in merged:
            other_step, other_numbers = merged[worker_id]
            merged[worker_id] = (max(step_id, other_step), other_numbers + numbers)
        else:
            merged[worker_id] = (step_id, numbers)
    return merged


class Outbox:
    """One worker's outputs until the scheduler role acknowledged them."""

    def __init__(self) -> None:
        self.worker_id = secrets.randbits(63)
        self._next = 1
        self._unacked: dict[int, Output] = {}
        self._lost: list[int] = []  # found dropped at the last `acknowledge`
        self.num_resent = 0  # outputs sent again (tests check that none is, unfaulted)

    def acknowledge(self, acks: Acks, processed_step: int) -> Output | None:
        """Forget the outputs `acks` says were applied; return the contents of those
        vLLM dropped (built for a step no later than `processed_step`), merged, to be
        sent again in this step's output."""
        if not self._unacked:
            return None
        upto, above = acks.get(self.worker_id, (0, ()))
        for number in [n for n in self._unacked if n <= upto or n in above]:
            del self._unacked[number]
        self._lost = [n for n, out in self._unacked.items() if out.step_id <= processed_step]
        if not self._lost:
            return None
        self.num_resent += len(self._lost)
        return merge_outputs(self._unacked[n] for n in self._lost)

    def record(self, output: Output) -> Sent:
        """Number `output` (if it holds anything), re-date the outputs sent again with it,
        and return this worker's entry for the output's metadata; empty when there is
        nothing to acknowledge."""
        numbers = list(self._lost)
        self._lost = []
        for number in numbers:
            self._unacked[number] = replace(self._unacked[number], step_id=output.step_id)
        if not output.is_empty:
            numbers.append(self._next)
            self._unacked[self._next] = output
            self._next += 1
        if not self._unacked:
            return {}
        return {self.worker_id: (output.step_id, tuple(numbers))}

    @property
    def is_idle(self) -> bool:
        """Return True when every output was acknowledged."""
        return not self._unacked


def merge_outputs(outputs: Iterable[Output]) -> Output:
    """Return the union of `outputs` (their reports' counts added up)."""
    outputs = list(outputs)
    return Output(
        max(out.step_id for out in outputs),
        WorkerReport.merge([out.report for out in outputs]),
        frozenset().union(*(out.finished_recving for out in outputs)),
        frozenset().union(*(out.failed_recving for out in outputs)),
        frozenset().union(*(out.invalid_blocks for out in outputs)),
    )


class Receipts:
    """The scheduler role's record of which worker outputs it applied.

    `processed_step` is the newest step whose outputs of all `num_workers` workers were
    applied: the oldest of each worker's newest applied step (0 until every worker's
    came). Not the newest of any worker's: vLLM can apply one rank's output of a step
    whose forward raised on another without it (Model Runner V1 with a batch queue), and
    that other rank's report of the failure comes only with a later step's output.
    """

    def __init__(self, num_workers: int = 1) -> None:
        self.processed_step = 0
        self._num_workers = num_workers
        self._steps: dict[int, int] = {}  # worker id -> newest step applied from it
        self._upto: dict[int, int] = {}
        self._above: dict[int, set[int]] = {}
        self._acks: dict[int, tuple[int, tuple[int, ...]]] = {}

    def note(self, sent: Sent) -> None:
        """Record the outputs of one applied worker metadata."""
        for worker_id, (step_id, numbers) in sent.items():
            self._note_worker_step(worker_id, step_id)
            upto = self._upto.get(worker_id, 0)
            above = self._above.setdefault(worker_id, set())
            again = [n for n in numbers if n <= upto or n in above]
            if again:  # vLLM applied an output kvtier took for dropped: counted twice
                logger.error("kvtier: worker outputs %s of %x applied twice", again, worker_id)
            above.update(n for n in numbers if n > upto)
            while upto + 1 in above:
                upto += 1
                above.remove(upto)
            self._upto[worker_id] = upto
            self._acks[worker_id] = (upto, tuple(sorted(above)))

    def note_steps(self, steps: Mapping[int, int]) -> None:
        """Record that vLLM applied the outputs of the workers `steps` names (empty ones
        too), each of the step it gives."""
        for worker_id, step_id in steps.items():
            self._note_worker_step(worker_id, step_id)

    def _note_worker_step(self, worker_id: int, step_id: int) -> None:
        steps = self._steps
        if step_id <= steps.get(worker_id, 0):
            return
        steps[worker_id] = step_id
        if len(steps) >= self._num_workers:
            self.processed_step = max(self.processed_step, min(steps.values()))

    def acks(self) -> Acks:
        """Return, per worker, what a plan acknowledges (a copy)."""
        return dict(self._acks)
