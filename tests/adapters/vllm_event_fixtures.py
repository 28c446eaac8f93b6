"""What the event tests against vLLM's own GPU events share: 64-token blocks hashed every
16 tokens, a vLLM request and GPU block pool to cache them in, the translator into vLLM's
event classes, and each stored hash's fields from a list of events (`by_hash`).

Imports vLLM: a test module calls `pytest.importorskip("vllm")` before importing this.
"""

from __future__ import annotations

from typing import Any

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
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout

SIZE, HBS = 64, 16
LAYOUT = KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, SIZE, 1),), configured_hash_block_size=HBS)
TRANSLATOR = EventTranslator(
    vllm_events.BlockStored,
    vllm_events.BlockRemoved,
    maybe_convert_block_hash,
    convert_extra_keys=to_event_extra_keys,
)
FIELDS = ("block_size", "token_ids", "parent_block_hash", "extra_keys")


def make_request(num_tokens: int, cache_salt: str | None = None) -> Request:
    """A request of `num_tokens` prompt tokens, hashed every HBS tokens (a cache salt
    adds extra keys to its first hash block)."""
    init_none_hash(sha256)
    return Request(
        request_id="r",
        prompt_token_ids=list(range(1000, 1000 + num_tokens)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(HBS, sha256),
        cache_salt=cache_salt,
    )


def gpu_pool() -> VllmBlockPool:
    """vLLM's GPU block pool of 8 blocks, caching with events on."""
    return VllmBlockPool(8, enable_caching=True, hash_block_size=HBS, enable_kv_cache_events=True)


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
