"""`KVTierConnector`'s Prometheus metrics and its stats through vLLM's logging and a
multi-connector front end."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from kvtier_vllm import (
    PROM_LABELS,
    SLOT_BYTES,
    freeze_stats_clock,
    observed_metrics,
)
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from test_vllm_observability import CPU_TIER_INFO, collect_stats
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm_harness import (
    ConnectorWorker,
    HarnessConfig,
    VllmHarness,
    connector_worker_factory,
    shared_prefix_prompts,
)

from kvtier.adapters.vllm import KVTierConnector
from kvtier.adapters.vllm.connector import register_with_vllm
from kvtier.adapters.vllm.stats import (
    stats_payload,
    unregister_kvtier_metrics,
)
from kvtier.offload.stats import OffloadStats

PROMPTS = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)


@pytest.fixture(autouse=True)
def _stats_clock_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    freeze_stats_clock(monkeypatch)


def test_prometheus_metrics_build_and_observe() -> None:
    harness, payloads = collect_stats()
    registry, _ = observed_metrics(harness, payloads)
    labels = PROM_LABELS
    value = registry.get_sample_value
    assert value("kvtier:loaded_blocks_total", labels) == 12
    assert value("kvtier:hit_tokens_total", labels) == 4 * 48
    assert value("kvtier:store_outcomes_total", {**labels, "outcome": "stored"}) >= 12
    assert value("kvtier:tier_blocks_in_use", labels) == 0
    info = {**labels, **CPU_TIER_INFO}
    assert value("kvtier:info", info) == 1
    assert value("kvtier:tier_hit_tokens_total", {**labels, "tier": "CPU"}) == 4 * 48
    loaded = {**labels, "transfer_type": "CPU_to_GPU"}
    assert value("kvtier:transfer_bytes_total", loaded) == 12 * 2 * 2048  # 12 blocks
    assert value("kvtier:transfer_seconds_total", loaded) > 0
    stored = {**labels, "transfer_type": "GPU_to_CPU"}
    assert value("kvtier:transfer_bytes_total", stored) >= 12 * 2 * 2048
    names = {m.name for m in registry.collect()}
    assert names
    assert all(name.startswith("kvtier:") for name in names)


def test_every_counter_reaches_the_payload_under_its_own_name() -> None:
    """Each statistic has its own value, so a counter fed from another one shows."""
    stats = OffloadStats(
        num_loaded_blocks=6,
        num_stored_blocks=7,
        num_failed_loads=8,
        num_failed_stores=9,
        num_bytes_loaded=10,
        num_bytes_stored=11,
        store_outcomes={"stored": 12},
        handoff_outcomes={"null": 13},
        num_tier_blocks_in_use=14,
        num_blocks_pending_store=15,
        num_disk_slots_held=21,
        num_demoted_blocks=5,
        num_failed_demotions=1,
        num_dropped_demotions=3,
        num_promoted_blocks=2,
        num_lost_blocks=4,
        num_tag_mismatches=18,
        transfer_bytes={"GPU_to_CPU": 19, "CPU_to_GPU": 20},
        transfer_seconds={"GPU_to_CPU": 0.25, "CPU_to_GPU": 0.5},
    )
    payload = stats_payload(stats, {"CPU": 16, "DISK": 17})
    assert payload["counters"] == {
        "loaded_blocks": 6,
        "stored_blocks": 7,
        "failed_loads": 8,
        "failed_stores": 9,
        "bytes_loaded": 10,
        "bytes_stored": 11,
        "hit_tokens": 33,
        "store_outcome.stored": 12,
        "handoff_outcome.null": 13,
        "tier_hit_tokens.CPU": 16,
        "tier_hit_tokens.DISK": 17,
        "demoted_blocks": 5,
        "failed_demotions": 1,
        "dropped_demotions": 3,
        "promoted_blocks": 2,
        "lost_blocks": 4,
        "tag_mismatches": 18,
        "transfer_bytes.GPU_to_CPU": 19,
        "transfer_bytes.CPU_to_GPU": 20,
        "transfer_seconds.GPU_to_CPU": 0.25,
        "transfer_seconds.CPU_to_GPU": 0.5,
    }
    assert payload["gauges"]["0"] == {
        "tier_blocks_in_use": 14,
        "blocks_pending_store": 15,
        "disk_slots_held": 21,
    }


def test_prometheus_metrics_can_be_built_twice_in_one_process() -> None:
    """vLLM rebuilds its Prometheus logger in one process (a second engine, a scale-up)."""
    harness, payloads = collect_stats()
    labels = {"model_name": "tiny", "engine": "0"}
    default_registry = {kind: kind for kind in (Counter, Gauge, Histogram)}  # as vLLM's logger
    try:
        for _ in range(2):
            metrics = KVTierConnector.build_prom_metrics(
                harness.vllm_config, default_registry, list(labels), {0: list(labels.values())}
            )
        for payload in payloads:
            metrics.observe(payload, engine_idx=0)
        assert REGISTRY.get_sample_value("kvtier:hit_tokens_total", labels) == 4 * 48
    finally:
        unregister_kvtier_metrics()
    assert REGISTRY.get_sample_value("kvtier:hit_tokens_total", labels) is None


def test_stats_of_a_multi_connector_child_survive_the_front_end() -> None:
    """MultiConnector rebuilds each child's stats in the front-end by registered name."""
    assert KVConnectorFactory.get_connector_class_by_name("KVTierConnector") is KVTierConnector
    register_with_vllm()  # a second registration is a no-op
    child = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.adapters.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": 256 * SLOT_BYTES},
    }
    cfg = HarnessConfig(connector="MultiConnector", extra_config={"connectors": [child]})
    harness = VllmHarness(cfg, connector_worker_factory)
    logging = KVConnectorLogging(harness.vllm_config.kv_transfer_config)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    for request_id, prompt in PROMPTS.items():
        harness.add_request(request_id, prompt, max_tokens=3)
    num_payloads = 0
    for record in busy_steps(harness):
        for outputs in record.outputs.values():
            stats = decoder.decode(encoder.encode(outputs)).scheduler_stats  # the IPC
            if stats is not None and stats.kv_connector_stats:
                logging.observe(stats.kv_connector_stats)
                num_payloads += 1
    assert num_payloads
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert "KVTierConnector={" in line
    assert "'stored_blocks': 12" in line  # 4 prompts of 3 full blocks
    for worker in harness.workers:
        assert isinstance(worker, ConnectorWorker)
        worker.connector.shutdown()
