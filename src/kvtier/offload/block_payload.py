"""What a request says about one of its blocks: the key it expects there, and the
`BlockStored` payload (tokens, parent, LoRA, extra keys) an eager store's event carries
(SPEC §6.10)."""

from __future__ import annotations

from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.offload.protocols import RequestView


def request_key(layout: KVLayout, request: RequestView, group_id: int, pos: int) -> Key | None:
    """Return the key of the request's block `pos` in a group, None before it is hashed."""
    ratio = layout.blocks_per_hash(group_id)
    index = (pos + 1) * ratio - 1
    if index >= len(request.block_hashes):
        return None
    return make_key(request.block_hashes[index], group_id)


def block_payload(layout: KVLayout, request: RequestView, group_id: int, pos: int) -> BlockStored:
    """Return the `BlockStored` payload of the request's block `pos` in a group."""
    group = layout.groups[group_id]
    ratio = layout.blocks_per_hash(group_id)
    hashes = request.block_hashes
    parent = hashes[pos * ratio - 1] if pos > 0 else None
    start = pos * group.block_size
    lora = request.lora
    return BlockStored(
        block_hash=hashes[(pos + 1) * ratio - 1],
        group_id=group_id,
        block_size=group.block_size,
        parent_block_hash=parent,
        token_ids=tuple(request.token_ids[start : start + group.block_size]),
        lora_id=None if lora is None else lora.lora_id,
        lora_name=None if lora is None else lora.lora_name,
        extra_keys=request.block_extra_keys(start, start + group.block_size),
        group_kind=group.kind.value,
        sliding_window=group.sliding_window,
        session_id=request.session_id,
    )
