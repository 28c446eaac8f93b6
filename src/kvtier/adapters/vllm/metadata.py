"""What the connector's two roles send each other through vLLM, once per step.

Scheduler → every worker: `KVTierMetadata` (kvtier's `TransferPlan` plus the request ids
of loads that will never run, which every worker reports back as failed so vLLM stops
waiting for them). Worker → scheduler: `KVTierWorkerMetadata` (kvtier's `WorkerReport`),
summed over ranks by vLLM's `KVOutputAggregator` through `aggregate`.

Both are plain picklable data: vLLM ships them between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.offload.plan import TransferPlan, WorkerReport


@dataclass(frozen=True)
class KVTierMetadata(KVConnectorMetadata):
    """One step's transfer plan, and loads to report as failed without running them.

    `unissued_failed_request_ids` are requests waiting for a load that kvtier dropped
    before any worker saw it (no lookup pin at allocation, or a cache reset): each
    worker echoes them in `failed_recving` and `finished_recving`.
    """

    plan: TransferPlan
    unissued_failed_request_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """The transfer events one rank (or several, aggregated) finished since its last step."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        """Return the sum of both reports (associative: counts per event add up)."""
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate KVTierWorkerMetadata with {type(other).__name__}")
        return KVTierWorkerMetadata(WorkerReport.merge([self.report, other.report]))
