"""Two kvtier connectors inside one vLLM `MultiConnector`: their gauges add up.

vLLM keys a `MultiConnector`'s stats by connector class name
(`MultiConnector.get_kv_connector_stats`), so two kvtier children's stats of one step
meet in `KVTierStats.aggregate`, the call that also merges a step's stats into an older
step's (per logging interval, and across ranks and roles). Regression: `aggregate` took
the newer stats' gauges, so the second child's replaced the first's instead of adding
to them (both stored the same blocks: `blocks_pending_store` showed 3 for 6 pending);
and a child with nothing new skips its stats, so a step could show one child's
gauges alone. Each connector's gauges are now kept apart by source and summed where
they are read (`reduce`, the Prometheus gauges).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from faulty_worker import FaultyWorker
from kvtier_vllm import PROM_LABELS, kvtier_harness
from multi_connector import multi_harness
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm_harness import VllmHarness, shared_prefix_prompts

from kvtier.adapters.vllm import KVTierConnector
from kvtier.adapters.vllm.stats import (
    KVTierStats,
    claim_source,
    release_source,
    summed_gauges,
)

PROMPTS = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
AGAIN = {f"again-{r}": [*p, 9] for r, p in PROMPTS.items()}
NAMES = ("tier_blocks_in_use", "blocks_pending_store", "disk_slots_held")


def kvtier_children(harness: VllmHarness) -> list[Any]:
    return [c for c in harness.scheduler.connector.sub_connectors if hasattr(c, "scheduler_side")]


def stores_pending_a_step(harness: VllmHarness) -> None:
    """Step every kvtier worker side's copies (`FaultyWorker`: each poll waits for the
    jobs started) and report each store the step after it was submitted, so the gauges
    are above 0 in the stats of the step that submitted it. Left to the copy threads, a
    store often finished and was reported within that step (gauges 0 in every payload:
    4 of 15 runs on a loaded machine), or several steps later."""
    for worker in harness.workers:
        for part in getattr(worker, "children", [worker]):
            side = getattr(getattr(part, "connector", None), "worker_side", None)
            if side is not None:
                FaultyWorker(side.worker, lambda blocks: None).hold["store"] = 1


def true_gauges(harness: VllmHarness) -> dict[str, int]:
    """The gauges summed over the kvtier children, read from their schedulers."""
    totals = dict.fromkeys(NAMES, 0)
    for child in kvtier_children(harness):
        for name, value in zip(NAMES, child.scheduler_side.offload.stats_gauges(), strict=True):
            totals[name] += value
    return totals


def prom_metrics(harness: VllmHarness) -> tuple[CollectorRegistry, Any]:
    registry = CollectorRegistry()
    metric_types = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    metrics = MultiConnector.build_prom_metrics(
        harness.vllm_config, metric_types, list(PROM_LABELS), {0: list(PROM_LABELS.values())}
    )
    return registry, metrics


def test_two_kvtier_childrens_gauges_add_up_in_every_view() -> None:
    harness = multi_harness(order=("kvtier", "kvtier"))
    assert len(kvtier_children(harness)) == 2
    stores_pending_a_step(harness)
    registry, metrics = prom_metrics(harness)
    interval = MultiConnector.build_kv_connector_stats()  # as vLLM's logging accumulates
    summed_steps = 0
    for batch in (PROMPTS, AGAIN):
        if batch is AGAIN:
            assert harness.scheduler.reset_prefix_cache()
        for request_id, prompt in batch.items():
            harness.add_request(request_id, prompt, 3)
        for record in busy_steps(harness):
            for outputs in record.outputs.values():
                stats = outputs.scheduler_stats
                payload = stats.kv_connector_stats if stats is not None else None
                if payload is not None:
                    metrics.observe(payload, engine_idx=0)
                    assert interval is not None
                    interval = interval.aggregate(MultiConnector.build_kv_connector_stats(payload))
            truth = true_gauges(harness)
            observed = {
                name: registry.get_sample_value(f"kvtier:{name}", PROM_LABELS) or 0
                for name in NAMES
            }
            assert observed == truth, "Prometheus gauges"
            assert interval is not None
            if not interval.is_empty():
                flat = interval.reduce()[KVTierConnector.__name__]
                assert {name: flat.get(name, 0) for name in NAMES} == truth, "logged gauges"
            summed_steps += any(truth[name] > 0 for name in NAMES)
    assert summed_steps  # the gauges moved
    harness.close()


def test_one_connectors_gauges_are_unchanged() -> None:
    """kvtier alone: the newest stats' gauges win, as before."""
    harness = kvtier_harness()
    registry = CollectorRegistry()
    metric_types = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    metrics = KVTierConnector.build_prom_metrics(
        harness.vllm_config, metric_types, list(PROM_LABELS), {0: list(PROM_LABELS.values())}
    )
    connector = harness.scheduler.connector
    for request_id, prompt in PROMPTS.items():
        harness.add_request(request_id, prompt, 3)
    for record in busy_steps(harness):
        for outputs in record.outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                metrics.observe(stats.kv_connector_stats, engine_idx=0)
        gauges = connector.scheduler_side.offload.stats_gauges()
        observed = tuple(
            registry.get_sample_value(f"kvtier:{name}", PROM_LABELS) or 0 for name in NAMES
        )
        assert observed == gauges
    harness.close()


def test_aggregate_keeps_each_sources_newest_gauges() -> None:
    """Stats of two sources add up; a source's newer stats replace its older ones."""
    a1 = KVTierConnector.build_kv_connector_stats(
        {"counters": {"loaded_blocks": 1}, "gauges": {"a": {"tier_blocks_in_use": 5}}}
    )
    b1 = {"counters": {"loaded_blocks": 2}, "gauges": {"b": {"tier_blocks_in_use": 3}}}
    a2 = {"counters": {}, "gauges": {"a": {"tier_blocks_in_use": 1}}}
    total = a1.aggregate(KVTierConnector.build_kv_connector_stats(b1))
    assert isinstance(total, KVTierStats)
    assert total.reduce() == {"loaded_blocks": 3, "tier_blocks_in_use": 8}
    total = total.aggregate(KVTierConnector.build_kv_connector_stats(a2))
    assert total.reduce() == {"loaded_blocks": 3, "tier_blocks_in_use": 4}
    assert b1["gauges"] == {"b": {"tier_blocks_in_use": 3}}  # the payloads are not changed


class Owner:
    """A connector's stand-in (weak references need a class)."""


def test_a_released_source_number_is_reused() -> None:
    """A connector rebuilt in one process takes its predecessor's source, not a new one
    (whose predecessor's last gauges would stay in the sums)."""
    owners = [Owner() for _ in range(4)]  # held weakly: freed with the list
    first = claim_source(owners[0])
    second = claim_source(owners[1])
    assert first != second
    release_source(first, owners[0])
    assert claim_source(owners[2]) == first
    release_source(first, owners[0])  # no longer its owner: nothing freed
    assert claim_source(owners[3]) not in (first, second)


def test_data_parallel_engines_gauges_add_up_in_the_aggregated_log_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's `--aggregate-engine-logging` merges the stats of every data-parallel engine
    (one process each) in one `KVConnectorLogging`. Regression: each engine's connector
    named its gauges' source "0", so the last engine's gauges replaced the others'."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.adapters.vllm import scheduler_stats

    harness = kvtier_harness()
    stores_pending_a_step(harness)
    try:
        for request_id, prompt in PROMPTS.items():
            harness.add_request(request_id, prompt, 3)
        busy = []  # payloads whose gauges are not all 0
        for record in busy_steps(harness):
            for outputs in record.outputs.values():
                stats = outputs.scheduler_stats
                payload = stats.kv_connector_stats if stats is not None else None
                if payload is not None and any(summed_gauges(payload["gauges"]).values()):
                    busy.append(payload)
        first = harness.scheduler.connector.scheduler_side
        # Engine 1 is another process: it claims the same small number, 0, and has its
        # own KV cache config (no sibling of engine 0's connector).
        monkeypatch.setattr(scheduler_stats, "claim_source", lambda owner: "0")
        harness.vllm_config.parallel_config.data_parallel_index = 1
        other = KVTierConnector(
            harness.vllm_config, KVConnectorRole.SCHEDULER, copy.copy(harness.kv_cache_config)
        )
        other.bind_gpu_block_pool(harness.scheduler.kv_cache_manager.block_pool)
        assert first.stats_source.startswith("0.")
        assert other.scheduler_side.stats_source == "1.0"
        other_stats = other.scheduler_side.take_stats()
        assert other_stats is not None
        assert busy
        first_stats = KVTierConnector.build_kv_connector_stats(busy[-1])
        gauges = {name: first_stats.reduce()[name] for name in NAMES}
        assert any(gauges.values())
        interval = KVTierStats(data={"counters": {}, "gauges": {}, "info": {}})
        interval.aggregate(first_stats).aggregate(other_stats)  # engine 1's are all 0
        assert {name: interval.reduce()[name] for name in NAMES} == gauges
    finally:
        harness.close()
