"""The token tags of live requests (SPEC §3 **Beyond**, the token check on hit).

`RequestTags` computes each request's tags (`kvtier.core.token_tags`) from its own tokens
and extra keys, one per hash block the engine hashed, growing them as the request does,
and keeps them until the request finishes. Stores record the tag of what they copy;
lookups count a tier block only where its tag is the request's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import BlockHash, Key, key_block_hash, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.core.token_tags import Tag, token_tag
from kvtier.offload.protocols import GpuPoolView, RequestView

# A block position's (key the request expects there, its token tag); None when not hashed.
TagOf = Callable[[int], "tuple[Key, Tag] | None"]


@dataclass(slots=True)
class _Chain:
    tags: list[Tag] = field(default_factory=list)
    by_hash: dict[BlockHash, Tag] = field(default_factory=dict)


class RequestTags:
    """Each live request's token tags, one per hash block of `hash_block_size` tokens."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.hash_block_size = layout.hash_block_size
        self._chains: dict[str, _Chain] = {}

    def of(self, request: RequestView) -> Sequence[Tag]:
        """Return the tags of every hash block the request has a hash for (a live list).

        Raises ValueError when the request holds fewer tokens than its hashes cover.
        """
        chain = self._chains.get(request.request_id)
        if chain is None:
            chain = self._chains[request.request_id] = _Chain()
        hashes = request.block_hashes
        tags = chain.tags
        if len(tags) < len(hashes):
            self._extend(request, chain, hashes)
        return tags

    def _extend(self, request: RequestView, chain: _Chain, hashes: Sequence[BlockHash]) -> None:
        size = self.hash_block_size
        tokens = request.token_ids
        if len(tokens) < len(hashes) * size:
            raise ValueError(
                f"request {request.request_id}: {len(tokens)} token ids cannot cover its "
                f"{len(hashes)} hash blocks of {size}"
            )
        tags = chain.tags
        parent = tags[-1] if tags else None
        for i in range(len(tags), len(hashes)):
            start = i * size
            extra = request.block_extra_keys(start, start + size)
            parent = token_tag(parent, tokens[start : start + size], extra)
            tags.append(parent)
            chain.by_hash[hashes[i]] = parent

    def by_position(self, request: RequestView, group_id: int) -> TagOf:
        """Return a lookup of (key, tag) by block position in one of the request's groups
        (a group's block j is tagged as hash block `(j + 1) * k - 1`, SPEC §3)."""
        tags = self.of(request)
        hashes = request.block_hashes
        ratio = self.layout.blocks_per_hash(group_id)

        def tag_of(pos: int) -> tuple[Key, Tag] | None:
            index = (pos + 1) * ratio - 1
            if index >= len(tags):
                return None
            return make_key(hashes[index], group_id), tags[index]

        return tag_of

    def of_block(
        self, request_id: str, gpu_pool: GpuPoolView, gpu_block_id: int
    ) -> tuple[Key, Tag] | None:
        """Return (key, tag) of a GPU block a request handed off, if its tags know the
        block's hash (they do once the request was scheduled after computing it)."""
        key = gpu_pool.key(gpu_block_id)
        chain = self._chains.get(request_id)
        if key is None or chain is None:
            return None
        tag = chain.by_hash.get(key_block_hash(key))
        return None if tag is None else (key, tag)

    def drop(self, request_id: str) -> None:
        """Forget a finished request's tags."""
        self._chains.pop(request_id, None)

    def clear(self) -> None:
        """Forget every request's tags."""
        self._chains.clear()

    def __len__(self) -> int:
        return len(self._chains)
