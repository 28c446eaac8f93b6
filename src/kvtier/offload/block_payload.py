"""What a request says about one of its blocks: the key it expects there, and the
`BlockStored` payload (tokens, parent, LoRA, extra keys) an eager store's event carries
(SPEC §6.10)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, key_block_hash, key_group_id, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.offload.protocols import GpuPoolView, Handoff, LoRAInfo, RequestView, StepInput
from kvtier.offload.store_batch import StoreBatch


def request_key(layout: KVLayout, request: RequestView, group_id: int, pos: int) -> Key | None:
    """Return the key of the request's block `pos` in a group, None before it is hashed."""
    ratio = layout.blocks_per_hash(group_id)
    index = (pos + 1) * ratio - 1
    if index >= len(request.block_hashes):
        return None
    return make_key(request.block_hashes[index], group_id)


def block_payload(layout: KVLayout, request: RequestView, group_id: int, pos: int) -> BlockStored:
    """Return the `BlockStored` payload of the request's block `pos` in a group."""
    ratio = layout.blocks_per_hash(group_id)
    size = layout.groups[group_id].block_size
    return _payload(layout, request, group_id, (pos + 1) * ratio - 1, pos * size, size)


def tail_payload(
    layout: KVLayout, request: RequestView, group_id: int, num_tokens: int
) -> BlockStored:
    """Return the `BlockStored` payload of the partial key ending at prefix `num_tokens`.

    `num_tokens`: a multiple of the hash block size, not of the group's block size. As
    vLLM's event for the same hash (`BlockPool.cache_partial_block`), it describes the
    key's last hash block: those tokens, its extra keys, and the hash before it as parent.
    """
    size = layout.hash_block_size
    return _payload(layout, request, group_id, num_tokens // size - 1, num_tokens - size, size)


def secondary_payloads(
    layout: KVLayout, request: RequestView, group_id: int, pos: int, keys: Iterable[Key]
) -> tuple[BlockStored, ...]:
    """Return the payloads of those `keys` (a GPU block's secondary keys) that are the
    request's partial entries of its block `pos` in a group, as `tail_payload` has them.

    A secondary key is a hash the block held before it filled (vLLM's partial entry): it
    is the request's only where it equals one of the block's hashes before its last
    (a chained hash names its tokens, parent and extra keys); other keys have none.
    """
    ratio = layout.blocks_per_hash(group_id)
    hashes = request.block_hashes
    first = pos * ratio
    last = min(first + ratio - 1, len(hashes))  # the block's own (last) hash excluded
    wanted = set(keys)
    size = layout.hash_block_size
    return tuple(
        tail_payload(layout, request, group_id, (index + 1) * size)
        for index in range(first, last)
        if make_key(hashes[index], group_id) in wanted
    )


def _payload(
    layout: KVLayout, request: RequestView, group_id: int, index: int, start: int, size: int
) -> BlockStored:
    """Return the payload of hash `index`, over the `size` tokens from `start`, chained to
    the hash one span (`size` tokens) earlier."""
    group = layout.groups[group_id]
    hashes = request.block_hashes
    step = size // layout.hash_block_size
    lora = request.lora
    return BlockStored(
        block_hash=hashes[index],
        group_id=group_id,
        block_size=size,
        parent_block_hash=hashes[index - step] if index >= step else None,
        token_ids=tuple(request.token_ids[start : start + size]),
        lora_id=None if lora is None else lora.lora_id,
        lora_name=None if lora is None else lora.lora_name,
        extra_keys=request.block_extra_keys(start, start + size),
        group_kind=group.kind.value,
        sliding_window=group.sliding_window,
        session_id=request.session_id,
    )


def describe_handoff(
    queued: StoreBatch,
    handoff: Handoff,
    view: RequestView | None,
    step: StepInput | None,
    noted: Mapping[int, LoRAInfo],
    pool: tuple[KVLayout, GpuPoolView] | None,
) -> None:
    """Give the hand-off just queued (the last of `queued`) what its payload-free event
    says of its request: the LoRA adapter, from its `view` (tracked) or as the `step`
    schedules it, else as `noted` per GPU block (`LazyWalk.loras`); with `pool` (events
    on), the extra keys of its block's key where that request's hashes name it."""
    if view is None and step is not None:
        found = (s.request for s in step.scheduled if s.request.request_id == handoff.request_id)
        view = next(found, None)
    index = len(queued) - 1
    lora = noted.get(handoff.gpu_block_id) if view is None else view.lora
    if lora is not None:
        queued.loras[index] = lora
    if pool is not None and view is not None:
        layout, gpu_pool = pool
        keys = key_extra_keys(layout, view, gpu_pool.key(handoff.gpu_block_id))
        if keys is not None:
            queued.extra_keys[index] = keys


def key_extra_keys(
    layout: KVLayout, request: RequestView, key: Key | None
) -> tuple[object, ...] | None:
    """Return the extra keys of the request's whole block whose key is `key` (searched
    from its latest hash: a hand-off offers a recent block), as its payload has them;
    None when `key` is none of its whole blocks' keys (a partial entry's, another's)."""
    if key is None:
        return None
    group_id, block_hash = key_group_id(key), key_block_hash(key)
    hashes = request.block_hashes
    index = next((i for i in range(len(hashes) - 1, -1, -1) if hashes[i] == block_hash), -1)
    ratio = layout.blocks_per_hash(group_id)
    if index < 0 or (index + 1) % ratio:
        return None
    size = layout.groups[group_id].block_size
    start = ((index + 1) // ratio - 1) * size
    return request.block_extra_keys(start, start + size)
