"""`KVTierStats` and `KVTierPromMetrics` on hand-made payloads: what vLLM's stats path
relies on beyond kvtier's own engine runs (test_vllm_observability.py)."""

from __future__ import annotations

import functools
import gc
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import kvtier_harness
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.adapters.vllm.stats import KVTierPromMetrics, KVTierStats, claim_source, live_sources

INFO = {"tier": "CPU", "store_mode": "eager", "num_tier_blocks": "8"}
INFO = {**INFO, "disk_io_mode": "", "cascade": "", "num_disk_blocks": ""}


def gauges(in_use: int) -> dict[str, int]:
    return {"tier_blocks_in_use": in_use, "blocks_pending_store": 0, "disk_slots_held": 0}


def test_reset_drops_every_section_and_an_info_payload_is_not_empty() -> None:
    """vLLM's `MultiKVConnectorStats.reset` resets its children: left over, an old
    interval's gauges and info would be summed into the next one. A payload holding only
    info is not empty: vLLM drops empty stats before they reach the info metric."""
    stats = KVTierStats(
        data={"counters": {"loaded_blocks": 3}, "gauges": {"0.0": gauges(5)}, "info": {}}
    )
    stats.reset()
    assert stats.is_empty()
    assert stats.data == {"counters": {}, "gauges": {}, "info": {}}
    assert not KVTierStats(data={"info": {"0.0": INFO}}).is_empty()


def prom_metrics(engines: int) -> tuple[CollectorRegistry, KVTierPromMetrics]:
    registry = CollectorRegistry()
    metric_types = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    config = SimpleNamespace(kv_transfer_config=None)
    labels = {engine: ["tiny", str(engine)] for engine in range(engines)}
    return registry, KVTierPromMetrics(config, metric_types, ["model_name", "engine"], labels)


def test_prometheus_gauges_sum_each_engine_s_own_sources() -> None:
    """A data-parallel front-end observes every engine's payloads in one process: an
    engine's gauges sum its own sources' newest values, never another engine's, and a
    source absent from a payload keeps its last values."""
    registry, metrics = prom_metrics(2)
    metrics.observe({"gauges": {"0.0": gauges(5)}}, engine_idx=0)
    metrics.observe({"gauges": {"1.0": gauges(2)}}, engine_idx=1)
    metrics.observe({"gauges": {"0.1": gauges(3)}}, engine_idx=0)  # a sibling of 0.0

    def in_use(engine: int) -> float | None:
        labels = {"model_name": "tiny", "engine": str(engine)}
        return registry.get_sample_value("kvtier:tier_blocks_in_use", labels)

    assert (in_use(0), in_use(1)) == (5 + 3, 2)


class Owner:
    """A connector's stand-in (weak references need a class)."""


def test_a_source_number_is_free_again_once_its_owner_is_collected() -> None:
    """An engine rebuilt without `shutdown` (its connector collected) takes the number
    back: otherwise every rebuild would name a new source."""
    gc.collect()  # owners of earlier tests: collected now, not between the two claims
    owner = Owner()
    number = claim_source(owner)
    del owner
    gc.collect()
    assert claim_source(Owner()) == number


def test_a_shut_down_scheduler_role_frees_its_stats_source() -> None:
    """`shutdown` releases the number while vLLM may still hold the connector."""
    harness = kvtier_harness()
    try:
        connector = harness.scheduler.connector
        assert any(owner is connector.scheduler_side for _, owner in live_sources())
        connector.shutdown()
        assert all(owner is not connector.scheduler_side for _, owner in live_sources())
    finally:
        harness.close()
