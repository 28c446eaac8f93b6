"""`EventTranslator.for_vllm`: vLLM's spec kind of every group and vLLM's own form of
extra keys; `vllm_medium` of media vLLM has no other name for."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvtier.adapters.vllm.events import EventTranslator, vllm_medium
from kvtier.core.events import BlockStored

HASH = bytes(range(32))


def hybrid_config() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64
    )
    groups = [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], window)]
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups)


def stored(group_id: int, extra_keys: tuple | None = None) -> BlockStored:
    return BlockStored(
        HASH, group_id, 16, token_ids=(1, 2), group_kind="kvtier's", extra_keys=extra_keys
    )


def test_every_group_s_events_name_vllm_s_spec_kind_of_it() -> None:
    translator = EventTranslator.for_vllm(hybrid_config())
    assert translator.group_spec_kinds == ("full_attention", "sliding_window")
    assert translator.translate(stored(1)).kv_cache_spec_kind == "sliding_window"


def test_extra_keys_are_published_untagged_as_vllm_publishes_them() -> None:
    """vLLM's hash-time extra keys are tagged (`("salt", ...)`, `("mm", id, offset)`);
    its events carry them untagged (`to_event_extra_keys`)."""
    translator = EventTranslator.for_vllm(hybrid_config())
    event = translator.translate(stored(0, (("salt", "s"), ("mm", "img", 3))))
    assert event.extra_keys == [("s", ("img", 3))]


def test_a_medium_vllm_has_no_name_for_passes_unchanged() -> None:
    assert vllm_medium("NVME") == "NVME"
    assert vllm_medium("DISK") == "STORAGE"
