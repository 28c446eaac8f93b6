"""`KVTierConnector`'s own rules, call by call (mutation run s30, mutconn2).

Each test pins one rule of the connector class (its start-up, its roles, its stats
payloads) that vLLM's usual call order (`vllm_harness`) passes without.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import kvtier_config, kvtier_harness
from vllm_harness import ConnectorWorker, FakeKVCache, VllmHarness

from kvtier.adapters.vllm import KVTierConnector
from kvtier.adapters.vllm.stats import live_sources


def test_each_role_refuses_the_other_roles_side_by_name() -> None:
    # Not a None that fails later as an AttributeError far from the misuse.
    harness = kvtier_harness()
    try:
        scheduler = harness.scheduler.connector
        worker = harness.workers[0].connector  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="not the worker role of KVTierConnector"):
            _ = scheduler.worker_side  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match="not the scheduler role of KVTierConnector"):
            _ = worker.scheduler_side
        with pytest.raises(RuntimeError, match="not the scheduler role"):
            worker.reset_cache()
    finally:
        harness.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_load_failure_policy_that_fails_requests_is_warned_at_start_up(
    caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    # vLLM's default ("fail") turns a failed tier load into a failed request.
    with caplog.at_level(logging.WARNING, logger="kvtier.adapters.vllm"):
        harness = kvtier_harness(kv_load_failure_policy=policy)
    harness.close()
    warned = [r.getMessage() for r in caplog.records if "kv_load_failure_policy=" in r.getMessage()]
    if policy == "recompute":
        assert warned == []
    else:
        (message,) = warned
        assert "kv_load_failure_policy='fail'" in message
        assert "set kv_load_failure_policy='recompute'" in message


def test_a_worker_reads_the_layout_resolved_into_its_kv_cache_config() -> None:
    # A worker spawned after the engine core resolved the layout learns it from
    # `KVCacheConfig.kv_cache_layout`; its own `cache_config.kv_cache_layout` is None.
    harness = VllmHarness(kvtier_config(extra={"num_blocks": 16}))
    try:
        harness.vllm_config.cache_config.kv_cache_layout = None
        cache = FakeKVCache(harness.kv_cache_config)
        worker = ConnectorWorker.create(harness.vllm_config, harness.kv_cache_config, cache)
        worker.connector.shutdown()
    finally:
        harness.close()


def test_a_shut_down_scheduler_role_frees_its_stats_source() -> None:
    # Its number goes to a connector built later (an engine restarted in this process),
    # though vLLM may keep the old connector object alive.
    harness = kvtier_harness()
    try:
        connector: Any = harness.scheduler.connector
        side = connector.scheduler_side
        assert any(owner is side for _, owner in live_sources())
        connector.shutdown()
        assert all(owner is not side for _, owner in live_sources())
    finally:
        harness.close()


def test_stats_rebuilt_from_a_payload_leave_the_payload_unchanged() -> None:
    # `aggregate` adds into the stats it is called on: a payload shared with them would
    # be counted again wherever else it is read (vLLM's logging and Prometheus both
    # rebuild stats from one payload).
    payload = {
        "counters": {"stored_blocks": 2},
        "gauges": {"0.0": {"tier_blocks_in_use": 3}},
        "info": {"0.0": {"tier": "cpu"}},
    }
    stats = KVTierConnector.build_kv_connector_stats(payload)
    other = {
        "counters": {"stored_blocks": 5},
        "gauges": {"0.0": {"tier_blocks_in_use": 1}},
        "info": {},
    }
    stats.aggregate(KVTierConnector.build_kv_connector_stats(other))
    assert stats.data["counters"] == {"stored_blocks": 7}
    assert stats.data["gauges"] == {"0.0": {"tier_blocks_in_use": 1}}
    assert payload == {
        "counters": {"stored_blocks": 2},
        "gauges": {"0.0": {"tier_blocks_in_use": 3}},
        "info": {"0.0": {"tier": "cpu"}},
    }


def test_both_roles_size_lazy_walks_by_vllms_batch_token_budget() -> None:
    # `max_batched_tokens` sets how many GPU free-queue blocks lazy mode visits per step
    # (`lazy_target`) and a cascade plan's demotions: vLLM's budget, not a default.
    harness = kvtier_harness(max_num_batched_tokens=64)
    try:
        assert harness.vllm_config.scheduler_config.max_num_batched_tokens == 64
        scheduler = harness.scheduler.connector
        worker = harness.workers[0].connector  # type: ignore[attr-defined]
        assert scheduler.offload_config.max_batched_tokens == 64  # type: ignore[union-attr]
        assert worker.offload_config.max_batched_tokens == 64
    finally:
        harness.close()


@pytest.mark.parametrize(("decode", "prefill"), [(2, 1), (1, 2)])
def test_either_kind_of_context_parallelism_is_refused_at_start_up(
    decode: int, prefill: int
) -> None:
    # A context-parallel rank holds a share of each block's tokens: its blocks are not
    # the prefix blocks kvtier keys them as.
    from kvtier.adapters.vllm.scheduler_side import SchedulerSide

    harness = kvtier_harness()
    try:
        connector: Any = harness.scheduler.connector
        parallel = harness.vllm_config.parallel_config
        parallel.decode_context_parallel_size = decode
        parallel.prefill_context_parallel_size = prefill
        with pytest.raises(ValueError, match="does not support context parallelism"):
            SchedulerSide(
                harness.vllm_config, harness.kv_cache_config, connector.offload_config, ()
            )
    finally:
        harness.close()
