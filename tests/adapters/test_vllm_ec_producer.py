"""vLLM's encoder-cache producer role, whose model runner never binds a KV plan.

Model Runner V1 returns from `execute_model` right after the encoder when the instance
has an EC connector that does not consume (`has_ec_transfer() and not
get_ec_transfer().is_consumer`), before any KV connector call: a kvtier worker there
would take every plan for one vLLM skipped (test_vllm_skipped_plan.py), fail its jobs
and count its step a failed forward's. No such worker exists: that role is exactly
vLLM's encode-only instance (`ECTransferConfig.is_encode_only`), which vLLM accepts
only for a multimodal model, runs with no KV cache (`get_kv_cache_spec` returns {}),
and for which it turns prefix caching off (`VllmConfig.__post_init__`); kvtier's
connector refuses to start without prefix caching. An `ec_both` instance consumes too,
and binds every plan as usual.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import kvtier_config
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_engine import build_vllm_config, write_tiny_llama

from kvtier.adapters.vllm import KVTierConnector


def test_the_roles_whose_runner_skips_kv_plans_are_the_encode_only_ones() -> None:
    for role in ("ec_producer", "ec_consumer", "ec_both"):
        config = ECTransferConfig(ec_connector="ECExampleConnector", ec_role=role)
        skips_kv_plans = not config.is_ec_consumer  # Model Runner V1's early return
        assert skips_kv_plans == config.is_encode_only == (role == "ec_producer")


def test_an_encode_only_instance_cannot_start_kvtier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM refuses an encode-only instance without a multimodal model, for which it
    sets `mm_encoder_only`; the tiny text model stands in for one here."""
    cfg = kvtier_config()
    write_tiny_llama(str(tmp_path), cfg)
    monkeypatch.setattr(VllmConfig, "is_mm_encoder_only", property(lambda self: True))
    vllm_config = build_vllm_config(cfg, str(tmp_path))
    assert not vllm_config.cache_config.enable_prefix_caching  # vLLM turned it off
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="needs prefix caching"):
            KVTierConnector(vllm_config, role, None)
