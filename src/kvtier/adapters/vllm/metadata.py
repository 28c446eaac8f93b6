"""What the connector's two roles send each other through vLLM, once per step.

Scheduler → every worker: `KVTierMetadata` (kvtier's `TransferPlan` plus the request ids
of loads that will never run, which every worker reports back as failed so vLLM stops
waiting for them). Worker → scheduler: `KVTierWorkerMetadata` (kvtier's `WorkerReport`),
summed over ranks by vLLM's `KVOutputAggregator` through `aggregate`. Each direction also
carries what `redelivery` needs to send again, once, an output vLLM dropped.

Both are plain picklable data: vLLM ships them between processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.adapters.vllm.redelivery import Acks, Sent, merge_sent
from kvtier.offload.plan import TransferPlan, WorkerReport


@dataclass(frozen=True)
class KVTierMetadata(KVConnectorMetadata):
    """One step's transfer plan, and loads to report as failed without running them.

    `unissued_failed_request_ids` are requests waiting for a load that kvtier dropped
    before any worker saw it (no lookup pin at allocation, or a cache reset): each
    worker echoes them in `failed_recving` and `finished_recving`.

    `fault_step`: the newest plan step id during which a forward failed on some rank, as
    far as the scheduler role had learned when it built this plan (0: none). A worker
    fails the stores of every plan built before the scheduler learned of a forward that
    failed on it (`WorkerSide.submit_stores`): one whose `fault_step` is older than that
    forward's step. A step id, not a count of failures: a count bumped by an earlier
    fault would let a plan built before a later one was known pass as built after it.

    `earlier_events`: the event ids of earlier plans still in flight, by plan step id. A
    worker that never bound one of those plans (vLLM's model runner raised before it
    did) reports their events failed when it binds this one (`WorkerSide.bind`).

    `earlier_echoes`: `unissued_failed_request_ids` of earlier plans vLLM has not yet
    reported finished on every rank, by plan step id: a worker that never bound one of
    those plans echoes them when it binds this one.

    `acks` and `processed_step`: the worker outputs the scheduler role has applied, and
    the newest step they came from; a worker sends again what vLLM dropped
    (`redelivery`).
    """

    plan: TransferPlan
    unissued_failed_request_ids: tuple[str, ...] = ()
    fault_step: int = 0
    earlier_events: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    acks: Acks = field(default_factory=dict)
    processed_step: int = 0
    earlier_echoes: Mapping[int, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """The transfer events one rank (or several, aggregated) finished since its last step.

    `failed_forward_step`: the newest plan step id during which a forward failed on the
    rank, until the rank gets a plan whose `KVTierMetadata.fault_step` is that step or
    later; None when there is none.

    `sent`: per worker, the step and the numbers of the outputs this one carries, for the
    scheduler role to acknowledge (`redelivery`).

    `steps`: per worker (`Outbox.worker_id`), the step of the newest plan the rank bound
    when it built this output: every output carries it, an empty one too, so that the
    scheduler role learns which steps' outputs of every rank it applied
    (`processed_step`). Per worker, not the newest of all: vLLM may apply one rank's
    output of a step without the others' (Model Runner V1 with a batch queue: a rank
    whose `execute_model` raised answers the step's `sample_tokens` with an empty
    output, and the healthy ranks' outputs are applied to the failed step alone).

    `recving`: per worker, the request ids the rank handed vLLM in `finished_recving`
    with this output (sent again ones too): vLLM's `KVOutputAggregator` counts those
    reports, but may count one twice or count one it never applies, so the scheduler
    role counts the workers itself (`finished_loads`).
    """

    report: WorkerReport = field(default_factory=WorkerReport)
    failed_forward_step: int | None = None
    sent: Sent = field(default_factory=dict)
    steps: Mapping[int, int] = field(default_factory=dict)
    recving: Mapping[int, frozenset[str]] = field(default_factory=dict)

    @property
    def step_id(self) -> int:
        """Return the newest step any worker aggregated here had bound (0: none)."""
        return max(self.steps.values(), default=0)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        """Return the sum of both reports (associative: counts per event add up), the
        later failed-forward step, both workers' output numbers, each worker's later
        step and each worker's finished loads."""
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate KVTierWorkerMetadata with {type(other).__name__}")
        steps = [s for s in (self.failed_forward_step, other.failed_forward_step) if s is not None]
        bound = dict(self.steps)
        for worker_id, step_id in other.steps.items():
            bound[worker_id] = max(step_id, bound.get(worker_id, 0))
        recving = dict(self.recving)
        for worker_id, req_ids in other.recving.items():
            recving[worker_id] = recving.get(worker_id, frozenset()) | req_ids
        return KVTierWorkerMetadata(
            WorkerReport.merge([self.report, other.report]),
            max(steps, default=None),
            merge_sent(self.sent, other.sent),
            bound,
            recving,
        )
