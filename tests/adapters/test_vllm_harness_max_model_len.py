"""The harness builds only engines vLLM would start: `max_model_len` fits the GPU blocks.

vLLM 0.33 refuses to start when one request of `max_model_len` tokens cannot fit its KV
cache (kv_cache_planning.py, `_check_enough_kv_cache_memory`), and its scheduler relies
on that: it readmits a preempted request only when the request's whole sequence fits
(`allocate_slots(full_sequence_must_fit=True)`, `scheduler_reserve_full_isl`). The
harness kept the model's 2048 tokens on a few dozen GPU blocks, so a request preempted
after it had grown past what the pool holds waited forever on an idle engine (the
fuzzing helper's seed 24380: 113 tokens need 8 blocks in each of 3 groups, 24 > 23
usable, with 23 free). The harness now lowers `max_model_len` as vLLM's auto-fit does,
and vLLM caps the request at that length.
"""

from __future__ import annotations

import collections
from functools import partial

import pytest

pytest.importorskip("vllm")

import random_ops_driver
from kvtier_vllm import kvtier_harness
from random_ops import Add, Engine
from vllm.v1.core.kv_cache_planning import check_enough_kv_cache_memory
from vllm_engine import KVGroupDef

WINDOWS = (KVGroupDef(16), KVGroupDef(16, 17), KVGroupDef(16, 48))


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_gpu_blocks": 12},
        {"num_gpu_blocks": 24, "kv_groups": WINDOWS},
        {"num_gpu_blocks": 16, "kv_groups": (KVGroupDef(16), KVGroupDef(16, mamba=True))},
    ],
    ids=["plain", "windows", "mamba"],
)
def test_vllm_would_start_the_harness_engine(overrides: dict[str, object]) -> None:
    harness = kvtier_harness(**overrides)  # type: ignore[arg-type]
    try:
        cfg, config = harness.cfg, harness.kv_cache_config
        specs = {n: g.kv_cache_spec for g in config.kv_cache_groups for n in g.layer_names}
        memory = cfg.num_gpu_blocks * cfg.num_layers * cfg.attention_spec.page_size_bytes
        check_enough_kv_cache_memory(harness.vllm_config, specs, memory)  # raises if not
        assert harness.scheduler.max_model_len < cfg.max_model_len
    finally:
        harness.close()


def test_request_preempted_past_the_pool_size_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 24380, minimised: three 85-token prompts of 30 tokens each, two steps in
    flight, prefill chunks of 16 tokens; the last is preempted three times, the third
    time at 113 tokens. On the old harness: 'engine still busy after 600 steps'."""
    build = partial(kvtier_harness, long_prefill_token_threshold=16)
    monkeypatch.setattr(random_ops_driver, "kvtier_harness", build)
    engine = Engine(
        "seed24380",
        store_mode="lazy",
        disk_only=True,
        async_batches=2,
        kv_groups=WINDOWS,
        num_gpu_blocks=24,
        scheduling_policy="priority",
        policy="lru+door",
        num_cpu_blocks=6,
    )
    totals: collections.Counter[str] = collections.Counter()
    random_ops_driver.run_example(engine, totals, [Add(3, 4, 4, 21, 2, 30, 2)], False)
    assert totals["preemptions"] > 0
