"""`KVTierConnector` under pipeline parallelism: every stage uses the same tier slots.

vLLM gives the scheduler stage 0's `KVCacheConfig`; each stage's worker holds only its own
layers. Here the harness's two ranks stand for two pipeline stages of a 5-layer model,
split 2 + 3 (`VLLM_PP_LAYER_PARTITION`), so stage 1's block ids span more bytes than the
scheduler's: sized from its own config alone, the scheduler would hand out slots stage 1
does not have.
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest

pytest.importorskip("vllm")

import vllm_engine
from kvtier_vllm import SLOT_BYTES, check_quiescent, kvtier_config, scheduler_side
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm_harness import (
    ConnectorWorker,
    FakeKVCache,
    HarnessConfig,
    VllmHarness,
    shared_prefix_prompts,
)
from vllm_workers import WorkerSide

from kvtier.adapters.vllm import worker_side
from kvtier.adapters.vllm.connector import KVTierConnector, pipeline_stage_layers
from kvtier.offload.plan import Tier

STAGE_LAYERS = (2, 3)
PAGE_BYTES = SLOT_BYTES // 2  # one layer's page of one block
# 40 slots of stage 0's blocks (2 layers); stage 1's 3-layer blocks fit 26 of them.
CPU_BYTES = 40 * 2 * PAGE_BYTES
NUM_SLOTS = CPU_BYTES // (3 * PAGE_BYTES)


def stage_kv_cache_config(cfg: HarnessConfig, vllm_config: object, stage: int) -> KVCacheConfig:
    """Plan one stage's KV cache as vLLM's engine core does (its own layers only)."""
    first = sum(STAGE_LAYERS[:stage])
    stage_cfg = replace(cfg, num_layers=STAGE_LAYERS[stage])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(first, first + stage_cfg.num_layers)]
    group = KVCacheGroupSpec(names, cfg.attention_spec)
    bytes_per_block = stage_cfg.num_layers * cfg.attention_spec.page_size_bytes
    config = get_kv_cache_config_from_groups(
        vllm_config, [group], cfg.num_gpu_blocks * bytes_per_block
    )
    config.kv_cache_layout = cfg.kv_cache_layout
    config.hash_block_size = cfg.block_size
    config.cache_hit_alignment_tokens = cfg.block_size
    return config


def pipeline_harness(
    monkeypatch: pytest.MonkeyPatch,
    first_stage: type[ConnectorWorker] = ConnectorWorker,
    last_stage: type[ConnectorWorker] = ConnectorWorker,
) -> VllmHarness:
    """Return a harness whose scheduler has stage 0's config and rank r is stage r
    (stage 0's worker role called as `first_stage` calls it, the last's as `last_stage`)."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", ",".join(map(str, STAGE_LAYERS)))
    build_vllm_config = vllm_engine.build_vllm_config
    build_kv_cache_config = vllm_engine.build_kv_cache_config

    def with_stages(cfg: HarnessConfig, model_dir: str) -> object:
        vllm_config = build_vllm_config(cfg, model_dir)
        # The harness's ranks (its tensor-parallel size) become the pipeline stages.
        vllm_config.parallel_config.pipeline_parallel_size = len(STAGE_LAYERS)
        return vllm_config

    def stage_zero(cfg: HarnessConfig, vllm_config: object) -> KVCacheConfig:
        build_kv_cache_config(cfg, vllm_config)  # sets the layout and block overrides
        return stage_kv_cache_config(cfg, vllm_config, 0)

    monkeypatch.setattr(vllm_engine, "build_vllm_config", with_stages)
    monkeypatch.setattr(vllm_engine, "build_kv_cache_config", stage_zero)

    def stage_worker(harness: VllmHarness, cache: FakeKVCache) -> WorkerSide:
        stage = harness.caches.index(cache)
        config = stage_kv_cache_config(harness.cfg, harness.vllm_config, stage)
        harness.caches[stage] = FakeKVCache(config)  # the fake forward fills this stage's
        last = stage == len(STAGE_LAYERS) - 1
        worker_type = first_stage if stage == 0 else last_stage if last else ConnectorWorker
        with (
            mock.patch.object(worker_side, "distributed_rank", return_value=stage),
            mock.patch.object(worker_side, "last_pipeline_stage", return_value=last),
        ):
            return worker_type.create(harness.vllm_config, config, harness.caches[stage])

    cfg = kvtier_config(
        num_layers=sum(STAGE_LAYERS),
        num_ranks=len(STAGE_LAYERS),
        num_gpu_blocks=64,
        extra={"cpu_bytes": CPU_BYTES},
    )
    return VllmHarness(cfg, stage_worker)


def connector(worker: WorkerSide) -> KVTierConnector:
    assert isinstance(worker, ConnectorWorker)
    assert isinstance(worker.connector, KVTierConnector)
    return worker.connector


def test_every_stage_sizes_its_tier_for_the_largest_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    harness = pipeline_harness(monkeypatch)
    assert pipeline_stage_layers(harness.vllm_config) == STAGE_LAYERS
    assert scheduler_side(harness).tier_sizes == {Tier.CPU: NUM_SLOTS}
    for stage, worker in enumerate(harness.workers):
        side = connector(worker).worker_side
        assert side.tier_sizes == {Tier.CPU: NUM_SLOTS}
        assert side.worker.bytes_per_slot == STAGE_LAYERS[stage] * PAGE_BYTES
        assert side.worker.bytes_per_slot * NUM_SLOTS <= CPU_BYTES


def test_a_full_tier_on_the_larger_stage_serves_every_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    harness = pipeline_harness(monkeypatch)
    # 24 prefixes of 3 blocks, one request at a time: the tier fills and evicts.
    prompts = shared_prefix_prompts(24, prefix_len=48, suffix_len=8, num_prefixes=24)
    for request_id, prompt in prompts.items():
        harness.run_requests({request_id: prompt}, max_tokens=2)
    assert harness.scheduler.reset_prefix_cache()
    again = {f"again-{r}": [*p, 9] for r, p in list(prompts.items())[-4:]}
    harness.run_requests(again, max_tokens=2)  # both stages' caches are checked
    assert all(harness.external_hit_tokens(r) == 48 for r in again)
    assert harness.finished == set(prompts) | set(again)
    check_quiescent(harness)
