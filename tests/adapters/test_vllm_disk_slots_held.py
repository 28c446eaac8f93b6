"""The `kvtier:disk_slots_held` gauge through vLLM: a disk-only tier's failed stores hold
their disk slots aside (`disk_slots`); the gauge shows them in the connector stats and in
Prometheus, and shows 0 again after a connector reset gives them back."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from faulty_worker import FaultyWorker
from kvtier_vllm import (
    PROM_LABELS,
    SLOT_BYTES,
    drain_collecting_stats,
    freeze_stats_clock,
    kvtier_harness,
    observed_metrics,
    offload_worker,
    scheduler_side,
)
from vllm_harness import shared_prefix_prompts

from kvtier.adapters.vllm.stats import summed_gauges


@pytest.fixture(autouse=True)
def _stats_clock_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    freeze_stats_clock(monkeypatch)


def test_held_disk_slots_of_failed_stores_show_in_the_stats_and_prometheus(
    tmp_path: Path,
) -> None:
    extra = {"cpu_bytes": 0, "disk_bytes": 64 * SLOT_BYTES, "disk_path": str(tmp_path)}
    extra["disk_io_mode"] = "page_cache"
    harness = kvtier_harness(extra=extra)
    worker = FaultyWorker(offload_worker(harness), lambda blocks: None)
    worker.fail["store"] = 1000  # every store fails
    prompts = shared_prefix_prompts(2, prefix_len=48, suffix_len=5, num_prefixes=2)
    for request_id, prompt in prompts.items():
        harness.add_request(request_id, prompt, max_tokens=3)
    payloads = drain_collecting_stats(harness)
    set_aside = scheduler_side(harness).offload.disk_set_aside
    assert set_aside is not None
    num_held = len(set_aside)
    failed = sum(p["counters"].get("failed_stores", 0) for p in payloads)  # type: ignore[attr-defined]
    assert num_held == failed >= 2 * 3  # the prompts' 3 full blocks each, at least
    gauges = summed_gauges(payloads[-1]["gauges"])  # type: ignore[arg-type]
    assert gauges["disk_slots_held"] == num_held

    registry, metrics = observed_metrics(harness, payloads)
    labels = PROM_LABELS
    assert registry.get_sample_value("kvtier:disk_slots_held", labels) == num_held

    connector = harness.scheduler.connector
    assert connector.get_kv_connector_stats() is None  # nothing changed since
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)
    stats = connector.get_kv_connector_stats()  # only the gauge changed: still reported
    assert stats is not None
    assert summed_gauges(stats.data["gauges"])["disk_slots_held"] == 0
    metrics.observe(stats.data, engine_idx=0)
    assert registry.get_sample_value("kvtier:disk_slots_held", labels) == 0
