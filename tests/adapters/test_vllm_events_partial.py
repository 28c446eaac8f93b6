"""kvtier's tier events against vLLM's own GPU events for the same hash, with partial
(fine-grained) prefix-cache entries: 64-token blocks hashed every 16 tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm_event_fixtures import HBS, LAYOUT, SIZE, TRANSLATOR, by_hash, gpu_pool, make_request

from kvtier.adapters.vllm.views import VllmGpuPoolView, VllmRequestView
from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import make_key
from kvtier.offload.block_payload import block_payload, tail_payload
from kvtier.offload.plan import Tier
from kvtier.offload.registration import Registrar
from kvtier.offload.store_batch import StoreBatch


def test_tier_events_of_a_block_s_keys_match_vllm_s_gpu_events() -> None:
    """A block cached whole (primary key) that also holds a partial entry (secondary key),
    and a partial tail: each CPU event carries the block size, tokens, parent and extra
    keys of vLLM's GPU event for the same hash, except what a payload-free secondary
    event cannot know."""
    request = make_request(SIZE + HBS)
    hashes = request.block_hashes
    gpu = gpu_pool()
    block, tail_block = gpu.get_new_blocks(2)
    gpu.cache_full_blocks(request, [block], 0, 1, SIZE, 0)
    gpu.cache_partial_block(request, block, 2 * HBS, 0, SIZE)  # a secondary key
    gpu.cache_partial_block(request, tail_block, SIZE + HBS, 0, SIZE)  # the tail's key
    gpu_events = by_hash(gpu.take_events(), "GPU")
    assert set(gpu_events) == {maybe_convert_block_hash(hashes[i]) for i in (3, 1, 4)}

    tier = BlockPool(4, record_events=True, medium="CPU")
    stores = StoreBatch()
    payload = block_payload(LAYOUT, VllmRequestView(request), 0, 0)
    stores.add(block.block_id, 1, make_key(hashes[3], 0), payload=payload)
    tail = tail_payload(LAYOUT, VllmRequestView(request), 0, SIZE + HBS)
    stores.add(tail_block.block_id, 2, make_key(hashes[4], 0), HBS, payload=tail)
    Registrar(LAYOUT, Tier.CPU, tier, events=True).register_all(
        stores, VllmGpuPoolView(gpu, (SIZE,))
    )
    cpu_events = by_hash(TRANSLATOR.translate_all(tier.take_events()), "CPU")
    full, partial, tail_hash = (maybe_convert_block_hash(hashes[i]) for i in (3, 1, 4))
    assert cpu_events[full] == gpu_events[full]
    assert cpu_events[tail_hash] == gpu_events[tail_hash]
    assert gpu_events[tail_hash][:3] == (HBS, request.all_token_ids[SIZE:], full)
    # A store batch without the secondary key's payload (selection captures it: see
    # test_vllm_events_payloads) publishes it payload-free: unknown, not wrong.
    assert cpu_events[partial][0] == gpu_events[partial][0] == HBS
    assert cpu_events[partial][1:] == ([], None, None)
