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


def test_plans_say_no_fault_until_a_worker_reports_one() -> None:
    """0 is "none": a plan saying 1 would pass for one built after a rank's failed
    forward of step 1 was known, and that rank would run its stores."""
    memory = PlanMemory(lambda event_id: False)
    assert memory.metadata(TransferPlan(1), ()).fault_step == 0
    memory.applied(KVTierWorkerMetadata(), KVConnectorOutput())
    assert memory.metadata(TransferPlan(2), ()).fault_step == 0


def test_a_plan_s_own_echoes_are_not_its_earlier_echoes() -> None:
    """A plan echoes its own never-issued loads; `earlier_echoes` are those of earlier
    plans, for a rank that never bound them, and a plan sent keeps what it said."""
    memory = PlanMemory(lambda event_id: False, num_workers=2)
    first = memory.metadata(TransferPlan(1), ("b",))
    assert (first.unissued_failed_request_ids, first.earlier_echoes) == (("b",), {})
    second = memory.metadata(TransferPlan(2), ("c",))
    assert second.earlier_echoes == {1: ("b",)}
    assert first.earlier_echoes == {}
    assert memory.metadata(TransferPlan(3), ()).earlier_echoes == {1: ("b",), 2: ("c",)}


def test_plans_acknowledge_the_worker_outputs_applied() -> None:
    """Each plan carries, per worker, the output numbers vLLM applied (all up to 2,
    and 4 above them): the worker sends 3 again, not the rest."""
    memory = PlanMemory(lambda event_id: False)
    assert memory.metadata(TransferPlan(1), ()).acks == {}
    memory.applied(KVTierWorkerMetadata(sent={7: (1, (1, 2, 4))}), KVConnectorOutput())
    assert memory.metadata(TransferPlan(2), ()).acks == {7: (2, (4,))}


def test_only_the_echoes_every_worker_reported_are_forgotten() -> None:
    memory = PlanMemory(lambda event_id: False)
    memory.metadata(TransferPlan(1), ("b",))
    memory.metadata(TransferPlan(2), ("c", "d"))
    finished = KVConnectorOutput(finished_recving={"b", "c"})
    memory.applied(KVTierWorkerMetadata(recving={0: frozenset({"b", "c"})}), finished)
    assert memory.echoes == {2: ("d",)}
    memory.echoes.clear()  # a copy: the memory keeps its own
    assert memory.metadata(TransferPlan(3), ()).earlier_echoes == {2: ("d",)}
