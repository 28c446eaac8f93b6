"""What the connector's scheduler role remembers of the plans it sent and the worker
outputs it applied, so that a fault on a rank loses nothing.

- `fault_step`: the newest step whose forward the workers reported failed; a plan built
  before the scheduler learned of one fails its stores on that rank
  (`WorkerSide.submit_stores`).
- `earlier_events` and `earlier_echoes`: per plan still relevant, its events in flight
  and the loads it echoed as never issued that vLLM has not yet seen from every rank. A
  rank that never bound that plan (vLLM's model runner raised first) fails the events
  and echoes the loads when it binds a later one.
- `acks` and `processed_step` (`redelivery.Receipts`): which worker outputs were
  applied, for a rank to send again an output vLLM dropped.
- `finished_loads`: which workers reported each load finished, so that vLLM is told a
  load finished once every worker reported it, however vLLM counted their reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.adapters.vllm.finished_loads import FinishedLoads
from kvtier.adapters.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.adapters.vllm.redelivery import Receipts
from kvtier.offload.plan import TransferPlan

T = TypeVar("T")


class PlanMemory:
    """The scheduler role's memory of its plans; `is_in_flight(event_id)` tells an
    event the offload scheduler still waits for."""

    def __init__(self, is_in_flight: Callable[[int], bool], num_workers: int = 1) -> None:
        self._is_in_flight = is_in_flight
        self.fault_step = 0
        self._events: dict[int, tuple[int, ...]] = {}
        self._echoes: dict[int, tuple[str, ...]] = {}
        self._receipts = Receipts(num_workers)
        self.finished_loads = FinishedLoads(num_workers)

    def metadata(self, plan: TransferPlan, echoes: tuple[str, ...]) -> KVTierMetadata:
        """Return the metadata that sends `plan`, echoing `echoes` as never issued."""
        earlier = self._earlier_events()
        if plan.jobs:
            self._events[plan.step_id] = tuple(job.event_id for job in plan.jobs)
        earlier_echoes = dict(self._echoes)
        if echoes:
            self._echoes[plan.step_id] = echoes
        receipts = self._receipts
        return KVTierMetadata(
            plan,
            echoes,
            self.fault_step,
            earlier,
            receipts.acks(),
            receipts.processed_step,
            earlier_echoes,
        )

    def applied(self, worker_meta: KVTierWorkerMetadata | None, connector_output: Any) -> None:
        """Note one output vLLM is applying (its `KVConnectorOutput`): its workers'
        outputs and failed forwards, and the loads finished on every rank, which
        `connector_output.finished_recving` is made to list (`FinishedLoads`)."""
        recving = worker_meta.recving if worker_meta is not None else {}
        self.finished_loads.correct(connector_output, recving)
        finished = connector_output.finished_recving
        if worker_meta is not None:
            if worker_meta.sent:
                self._receipts.note(worker_meta.sent)
            self._receipts.note_steps(worker_meta.steps)
            failed_step = worker_meta.failed_forward_step
            if failed_step is not None and failed_step > self.fault_step:
                self.fault_step = failed_step  # later plans' stores run again
        if self._echoes and finished:
            self._echoes = _without(self._echoes, lambda r: r in finished)

    @property
    def echoes(self) -> dict[int, tuple[str, ...]]:
        """Return the echoes some rank may not have reported yet, by step id (a copy)."""
        return dict(self._echoes)

    @property
    def processed_step(self) -> int:
        """Return the newest plan step whose outputs of every worker vLLM applied (0:
        none)."""
        return self._receipts.processed_step

    def _earlier_events(self) -> dict[int, tuple[int, ...]]:
        """Return the events of earlier plans still in flight, by step id (forgetting
        the rest): a rank that skipped one of those plans has not reported them."""
        in_flight = self._is_in_flight
        self._events = _without(self._events, lambda e: not in_flight(e))
        return dict(self._events)


def _without(
    by_step: dict[int, tuple[T, ...]], done: Callable[[T], bool]
) -> dict[int, tuple[T, ...]]:
    """Return `by_step` without the items `done` picks, and without steps left empty."""
    kept = {}
    for step_id, items in by_step.items():
        left = tuple(item for item in items if not done(item))
        if left:
            kept[step_id] = left
    return kept
