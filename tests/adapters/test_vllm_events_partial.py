"""kvtier's tier events against vLLM's own GPU events for the same hash, with partial
(fine-grained) prefix-cache entries: 64-token blocks hashed every 16 tokens."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed import kv_events as vllm_events
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.request import Request

from kvtier.adapters.vllm.events import EventTranslator
from kvtier.adapters.vllm.views import VllmGpuPoolView, VllmRequestView
from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.block_payload import block_payload, tail_payload
from kvtier.offload.plan import Tier
from kvtier.offload.registration import Registrar
from kvtier.offload.store_batch import StoreBatch

SIZE, HBS = 64, 16
FIELDS = ("block_size", "token_ids", "parent_block_hash", "extra_keys")


def fields(event: Any) -> tuple[Any, ...]:
    return tuple(getattr(event, name) for name in FIELDS)


def by_hash(events: list[Any], medium: str) -> dict[Any, tuple[Any, ...]]:
    """Each stored hash's fields, one block of a batched vLLM event at a time."""
    out = {}
    for e in events:
        if isinstance(e, vllm_events.BlockStored) and e.medium == medium:
            for i, h in enumerate(e.block_hashes):
                size, tokens, parent, extra = fields(e)
                first = i * size
                out[h] = (
                    size,
                    tokens[first : first + size],
                    parent if i == 0 else e.block_hashes[i - 1],
                    None if extra is None else [extra[i]],
                )
    return out


def test_tier_events_of_a_block_s_keys_match_vllm_s_gpu_events() -> None:
    """A block cached whole (primary key) that also holds a partial entry (secondary key),
    and a partial tail: each CPU event carries the block size, tokens, parent and extra
    keys of vLLM's GPU event for the same hash, except what a payload-free secondary
    event cannot know."""
    init_none_hash(sha256)
    request = Request(
        request_id="r",
        prompt_token_ids=list(range(1000, 1000 + SIZE + HBS)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(HBS, sha256),
    )
    hashes = request.block_hashes
    gpu = VllmBlockPool(8, enable_caching=True, hash_block_size=HBS, enable_kv_cache_events=True)
    block, tail_block = gpu.get_new_blocks(2)
    gpu.cache_full_blocks(request, [block], 0, 1, SIZE, 0)
    gpu.cache_partial_block(request, block, 2 * HBS, 0, SIZE)  # a secondary key
    gpu.cache_partial_block(request, tail_block, SIZE + HBS, 0, SIZE)  # the tail's key
    gpu_events = by_hash(gpu.take_events(), "GPU")
    assert set(gpu_events) == {maybe_convert_block_hash(hashes[i]) for i in (3, 1, 4)}

    layout = KVLayout(
        (KVGroupSpec(GroupKind.FULL_ATTENTION, SIZE, 1),), configured_hash_block_size=HBS
    )
    tier = BlockPool(4, record_events=True, medium="CPU")
    stores = StoreBatch()
    payload = block_payload(layout, VllmRequestView(request), 0, 0)
    stores.add(block.block_id, 1, make_key(hashes[3], 0), payload=payload)
    tail = tail_payload(layout, VllmRequestView(request), 0, SIZE + HBS)
    stores.add(tail_block.block_id, 2, make_key(hashes[4], 0), HBS, payload=tail)
    Registrar(layout, Tier.CPU, tier, events=True).register_all(
        stores, VllmGpuPoolView(gpu, (SIZE,))
    )
    translator = EventTranslator(
        vllm_events.BlockStored,
        vllm_events.BlockRemoved,
        maybe_convert_block_hash,
        convert_extra_keys=to_event_extra_keys,
    )
    cpu_events = by_hash(translator.translate_all(tier.take_events()), "CPU")
    full, partial, tail_hash = (maybe_convert_block_hash(hashes[i]) for i in (3, 1, 4))
    assert cpu_events[full] == gpu_events[full]
    assert cpu_events[tail_hash] == gpu_events[tail_hash]
    assert gpu_events[tail_hash][:3] == (HBS, request.all_token_ids[SIZE:], full)
    # A store batch without the secondary key's payload (selection captures it: see
    # test_vllm_events_payloads) publishes it payload-free: unknown, not wrong.
    assert cpu_events[partial][0] == gpu_events[partial][0] == HBS
    assert cpu_events[partial][1:] == ([], None, None)
