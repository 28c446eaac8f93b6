"""kvtier under vLLM's external launcher (torchrun, `distributed_executor_backend=
'external_launcher'`): each engine runs one rank (`ExecutorWithExternalLauncher`) and
aggregates no outputs, while its `parallel_config.world_size` counts every engine's ranks
(times `data_parallel_size`). The harness's one worker plays the engine's one rank."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm_engine
from kvtier_vllm import SLOT_BYTES, kvtier_harness, scheduler_side

from kvtier.adapters.vllm.connector import connector_config
from kvtier.adapters.vllm.scheduler_side import _workers_heard

PROMPT = list(range(100, 165))  # 4 full blocks and one token


def launched(monkeypatch: pytest.MonkeyPatch, data_parallel: int, tensor_parallel: int) -> None:
    """Make the harness's vLLM config an external launcher's (world size as vLLM sets it)."""
    build_vllm_config = vllm_engine.build_vllm_config

    def with_launcher(cfg: Any, model_dir: str) -> Any:
        vllm_config = build_vllm_config(cfg, model_dir)
        parallel = vllm_config.parallel_config
        parallel.distributed_executor_backend = "external_launcher"
        parallel.data_parallel_size = data_parallel
        parallel.tensor_parallel_size = tensor_parallel
        parallel.world_size = tensor_parallel * data_parallel  # `ParallelConfig.__post_init__`
        return vllm_config

    monkeypatch.setattr(vllm_engine, "build_vllm_config", with_launcher)


def test_a_data_parallel_engine_hears_its_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # Was: 'engine still busy after 300 steps': every transfer event waited for a report
    # of `world_size` (2) workers, and this engine has one, so no store ever completed.
    launched(monkeypatch, data_parallel=2, tensor_parallel=1)
    harness = kvtier_harness()
    try:
        harness.run_requests({"a": PROMPT}, max_tokens=2, max_steps=300)
        assert not scheduler_side(harness).has_pending_stores()
        assert harness.scheduler.reset_prefix_cache()
        harness.run_requests({"b": [*PROMPT, 1]}, max_tokens=2, max_steps=300)
        assert harness.external_hit_tokens("b") == 64  # checked KV (the harness's fingerprints)
    finally:
        harness.close()


def test_tensor_parallel_engines_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Was: accepted, then as above (and the engines would plan different prefix hits).
    launched(monkeypatch, data_parallel=1, tensor_parallel=2)
    with pytest.raises(ValueError, match="external_launcher"):
        kvtier_harness()


@pytest.mark.parametrize(
    ("backend", "tensor", "pipeline", "world", "heard"),
    [
        ("mp", 2, 2, 4, 4),  # every rank's output, aggregated
        ("external_launcher", 1, 1, 2, 1),  # its own rank's only (two data-parallel engines)
        ("external_launcher", 2, 1, 2, None),
        ("external_launcher", 1, 2, 2, None),
    ],
)
def test_the_workers_heard_and_the_launcher_s_refused_groups(
    backend: str, tensor: int, pipeline: int, world: int, heard: int | None
) -> None:
    """The launcher refuses a pipeline's stages as it refuses tensor ranks: each stage's
    engine would plan alone (called directly: the harness builds no pipeline stage's
    KV cache, and the tier sizing would refuse its whole model first)."""
    parallel = SimpleNamespace(
        distributed_executor_backend=backend,
        tensor_parallel_size=tensor,
        pipeline_parallel_size=pipeline,
        world_size=world,
    )
    if heard is None:
        with pytest.raises(ValueError, match="external_launcher"):
            _workers_heard(parallel)
    else:
        assert _workers_heard(parallel) == heard


def test_cpu_bytes_to_use_is_shared_by_the_engines_as_vllm_shares_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM 0.33's SimpleCPUOffloadConnector (`cpu_bytes_to_use // world_size`) and
    # OffloadingConnector (chunks of `world_size` workers' blocks) divide by the
    # launcher's world size, every engine's ranks: so does kvtier, and a config moved
    # between them keeps its memory. `cpu_bytes_to_use_per_rank` is one engine's.
    launched(monkeypatch, data_parallel=2, tensor_parallel=1)
    harness = kvtier_harness()
    try:
        transfer = harness.vllm_config.kv_transfer_config
        transfer.kv_connector_extra_config = {"cpu_bytes_to_use": 64 * SLOT_BYTES}
        assert connector_config(harness.vllm_config).cpu_bytes == 32 * SLOT_BYTES
        transfer.kv_connector_extra_config = {"cpu_bytes_to_use_per_rank": 64 * SLOT_BYTES}
        assert connector_config(harness.vllm_config).cpu_bytes == 64 * SLOT_BYTES
    finally:
        harness.close()
