"""`PlanMemory`: what the scheduler role remembers of its plans and of the worker
outputs vLLM applied, and what it sends with each later plan (no engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput

from kvtier.adapters.vllm.metadata import KVTierWorkerMetadata
from kvtier.adapters.vllm.plan_memory import PlanMemory
from kvtier.offload.plan import Tier, TransferJob, TransferPlan


def store(event_id: int) -> TransferJob:
    return TransferJob(event_id, Tier.GPU, Tier.CPU, (1,), (2,))


def test_a_fault_reported_late_for_an_older_step_keeps_the_newer_fault_step() -> None:
    """Rank 0 reports its forward of step 5 failed; rank 1's report of step 3 comes
    later (salvaged). Plans must go on saying 5: a rank whose step-5 forward failed
    fails the stores of every plan whose `fault_step` is older."""
    memory = PlanMemory(lambda event_id: False, num_workers=2)
    memory.applied(KVTierWorkerMetadata(failed_forward_step=5), KVConnectorOutput())
    memory.applied(KVTierWorkerMetadata(failed_forward_step=3), KVConnectorOutput())
    assert memory.fault_step == 5
    assert memory.metadata(TransferPlan(6), ()).fault_step == 5


def test_only_events_still_in_flight_are_sent_as_earlier_events() -> None:
    """An earlier plan's events the offload scheduler no longer waits for are forgotten:
    a rank that skipped that plan must not fail them, and plans must not grow."""
    in_flight = {10, 11}
    memory = PlanMemory(in_flight.__contains__)
    assert memory.metadata(TransferPlan(1, (store(10), store(11))), ()).earlier_events == {}
    assert memory.metadata(TransferPlan(2, (store(12),)), ()).earlier_events == {1: (10, 11)}
    in_flight.discard(10)  # event 10 reported done by every rank; 12 too
    assert memory.metadata(TransferPlan(3), ()).earlier_events == {1: (11,)}
    in_flight.clear()
    assert memory.metadata(TransferPlan(4), ()).earlier_events == {}


def test_a_step_is_processed_only_once_every_worker_s_output_of_it_was_applied() -> None:
    """vLLM may apply one rank's output of a step without the other's: until the other
    rank's comes, its output of that step may still be in flight, not dropped."""
    memory = PlanMemory(lambda event_id: False, num_workers=2)
    memory.applied(KVTierWorkerMetadata(steps={1: 3}), KVConnectorOutput())
    assert memory.processed_step == 0
    assert memory.metadata(TransferPlan(4), ()).processed_step == 0
    memory.applied(KVTierWorkerMetadata(steps={2: 2}), KVConnectorOutput())
    assert memory.processed_step == 2
    assert memory.metadata(TransferPlan(5), ()).processed_step == 2
