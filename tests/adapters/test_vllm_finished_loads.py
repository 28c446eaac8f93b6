"""`FinishedLoads`: vLLM is told a load finished once every worker reported it, each
worker counted once however often its report arrives (`finished_loads`): Scenario 26
for loads under vLLM's own aggregation of worker outputs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput

from kvtier.adapters.vllm.finished_loads import FinishedLoads
from kvtier.adapters.vllm.metadata import KVTierWorkerMetadata
from kvtier.adapters.vllm.plan_memory import PlanMemory
from kvtier.offload.plan import TransferPlan


def listed(loads: FinishedLoads, vllm_lists: set[str] | None, **recving: set[str]) -> set[str]:
    """Return what vLLM reads after `update_connector_output` of one output in which
    vLLM's aggregate listed `vllm_lists` and the workers named by `recving`'s keys
    ("w<id>") reported their sets."""
    output = KVConnectorOutput(finished_recving=vllm_lists)
    by_worker = {int(name[1:]): frozenset(ids) for name, ids in recving.items()}
    loads.correct(output, by_worker)
    return output.finished_recving or set()


def test_agreeing_counts_pass_unchanged() -> None:
    loads = FinishedLoads(num_workers=2)
    output = KVConnectorOutput(finished_recving={"other"})
    loads.correct(output, {})
    assert output.finished_recving == {"other"}  # another connector's, and the fast path
    assert listed(loads, None, w1={"b"}) == set()
    assert listed(loads, {"b"}, w2={"b"}) == {"b"}
    assert loads.num_pending == 0


def test_a_request_vllm_lists_early_is_held_back_until_every_worker_reported_it() -> None:
    loads = FinishedLoads(num_workers=2)
    assert listed(loads, None, w1={"b"}) == set()
    # vLLM counted w1's report twice (an output it never applied, sent again): b listed
    assert listed(loads, {"b", "other"}, w1={"b"}) == {"other"}
    assert loads.num_pending == 1
    assert listed(loads, None, w2={"b"}) == {"b"}  # vLLM's new count of b never ends
    assert loads.num_pending == 0


def test_a_request_listed_early_in_an_output_naming_no_worker_s_report_is_held_back() -> None:
    # The rule holds whatever the output carries: no worker's report in it is no reason
    # to pass vLLM's early listing (a mutant returning whenever `recving` was empty).
    loads = FinishedLoads(num_workers=2)
    assert listed(loads, None, w1={"b"}) == set()
    assert listed(loads, {"b", "other"}) == {"other"}
    assert listed(loads, None, w2={"b"}) == {"b"}


def test_a_request_whose_listing_vllm_lost_is_listed_once_every_worker_reported_it() -> None:
    loads = FinishedLoads(num_workers=3)
    assert listed(loads, None, w1={"b"}, w2={"b", "c"}) == set()
    assert listed(loads, None, w3={"b"}) == {"b"}  # vLLM listed b in an aggregate it lost
    assert listed(loads, {"c"}, w1={"c"}, w3={"c"}) == {"c"}


def test_aggregated_metadata_keeps_each_worker_s_finished_loads() -> None:
    a, b = KVTierWorkerMetadata(recving={1: frozenset({"x"})}), KVTierWorkerMetadata()
    later = KVTierWorkerMetadata(recving={1: frozenset({"y"}), 2: frozenset({"x"})})
    merged = a.aggregate(b).aggregate(later)
    assert merged.recving == {1: frozenset({"x", "y"}), 2: frozenset({"x"})}
    assert b.aggregate(a).recving == a.recving


def test_an_echo_is_forgotten_once_every_worker_reported_it_not_as_vllm_lists_it() -> None:
    # Echoes of never-issued loads ride on every plan until each rank reported them;
    # the scheduler role forgets one by the corrected listing: forgotten at vLLM's early
    # listing, a rank yet to report it would never hear of it; kept past a listing vLLM
    # lost, every later plan would carry it (a mutant reading vLLM's listing as is).
    memory = PlanMemory(lambda event_id: False, num_workers=2)
    memory.metadata(TransferPlan(1), ("b",))
    early = KVConnectorOutput(finished_recving={"b"})
    memory.applied(KVTierWorkerMetadata(recving={0: frozenset({"b"})}), early)
    assert not early.finished_recving
    assert memory.echoes == {1: ("b",)}
    lost = KVConnectorOutput()
    memory.applied(KVTierWorkerMetadata(recving={1: frozenset({"b"})}), lost)
    assert lost.finished_recving == {"b"}
    assert memory.echoes == {}


def test_every_request_completed_in_one_output_is_forgotten() -> None:
    # Two loads completed by the same output: both counts end. A count kept past its
    # completion (a mutant forgetting only one) would pass a later load of the same id
    # for finished at its first worker's report: vLLM would read KV still in flight.
    loads = FinishedLoads(num_workers=2)
    assert listed(loads, None, w1={"a", "b"}) == set()
    assert listed(loads, {"a", "b"}, w2={"a", "b"}) == {"a", "b"}
    assert loads.num_pending == 0
    assert listed(loads, None, w1={"a", "b"}) == set()  # the ids used again
    assert listed(loads, {"a", "b"}, w2={"a", "b"}) == {"a", "b"}
