"""The token tags of live requests and GPU blocks (SPEC §3 **Beyond**, the token check).

`RequestTags` computes each request's tags (`kvtier.core.token_tags`) from its own tokens
and extra keys, one per hash block the engine hashed, growing them as the request does,
and keeps them until the request finishes. Stores record the tag of what they copy;
lookups count a tier block only where its tag is the request's own.

What a GPU block holds was computed (or loaded through the check) by the request that
filled it, not necessarily by the request storing it: a block shared through the GPU
prefix cache came from another request, whose tokens may differ under the same hash (the
GPU cache has no check). So a request tags only the positions it filled itself, at or
after the local prefix its last lookup reported; it notes those fills per GPU block, and
a shared block is stored with the tag its filler noted, or with none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import BlockHash, Key, key_block_hash, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.core.token_tags import Tag, chain_tags
from kvtier.offload.protocols import GpuPoolView, RequestView

# The tag to record for a block: (position, GPU block id, the block's key) -> tag or None.
TagOf = Callable[[int, int, Key], "Tag | None"]


@dataclass(slots=True)
class _Chain:
    tags: list[Tag] = field(default_factory=list)
    # hash -> tag; None for a hash the chain holds twice (a collision inside the request).
    by_hash: dict[BlockHash, Tag | None] = field(default_factory=dict)


class RequestTags:
    """Live requests' token tags, one per hash block, and the tags of GPU blocks' fills."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.hash_block_size = layout.hash_block_size
        self._chains: dict[str, _Chain] = {}
        self._local: dict[str, int] = {}  # request -> local prefix tokens at its last lookup
        self._gpu: dict[int, tuple[Key, Tag]] = {}  # GPU block -> (key, tag) of its last fill

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
        by_hash = chain.by_hash
        first = len(tags)
        new = chain_tags(
            tags[-1] if tags else None, tokens, size, first, len(hashes), request.block_extra_keys
        )
        for block_hash, tag in zip(hashes[first:], new, strict=True):
            by_hash[block_hash] = None if block_hash in by_hash else tag
        tags.extend(new)

    def expected(self, request: RequestView) -> Callable[[BlockHash], Tag | None]:
        """Return the request's tag by block hash; None for a hash it lacks or holds twice
        (its chain collides with itself: no position can be checked by hash alone)."""
        self.of(request)
        return self._chains[request.request_id].by_hash.get

    def note_lookup(self, request_id: str, num_local_tokens: int) -> None:
        """Record the local prefix a lookup reported: the request fills what follows."""
        self._local[request_id] = num_local_tokens

    def floor(self, request_id: str, group_id: int) -> int:
        """Return the first block position of a group the request fills itself."""
        return self._local.get(request_id, 0) // self.layout.groups[group_id].block_size

    def noted(self, gpu_block_id: int, key: Key) -> Tag | None:
        """Return the tag noted for the last fill of a GPU block, if it was under `key`."""
        noted = self._gpu.get(gpu_block_id)
        return noted[1] if noted is not None and noted[0] == key else None

    def by_position(self, request: RequestView, group_id: int) -> TagOf:
        """Return the tag lookup for one of the request's groups, noting its own fills.

        At or after the local prefix, block j was filled by the request (computed, or
        loaded through the check): its tag is the request's tag of hash block
        `(j + 1) * k - 1` (SPEC §3) when the block's key is the request's; the fill is
        noted. Before it, the block is shared: the tag its filler noted, if the key agrees.
        """
        tags = self.of(request)
        hashes = request.block_hashes
        ratio = self.layout.blocks_per_hash(group_id)
        floor = self.floor(request.request_id, group_id)
        gpu = self._gpu

        def tag_of(pos: int, gpu_block_id: int, key: Key) -> Tag | None:
            if pos < floor:
                return self.noted(gpu_block_id, key)
            index = (pos + 1) * ratio - 1
            if index >= len(tags) or make_key(hashes[index], group_id) != key:
                return None
            gpu[gpu_block_id] = (key, tags[index])
            return tags[index]

        return tag_of

    def forget_fills(
        self,
        request_id: str,
        new_ids_per_group: Sequence[Sequence[int]],
        firsts: Sequence[int] | None,
    ) -> None:
        """Forget the noted fills of GPU blocks newly given to a request, at positions
        `firsts[g]`, `firsts[g] + 1`, ... of group g (from 0 when None): those at or after
        its local prefix are filled anew."""
        for group_id, block_ids in enumerate(new_ids_per_group):
            floor = self.floor(request_id, group_id)
            first = 0 if firsts is None else firsts[group_id]
            for pos, block_id in enumerate(block_ids, first):
                if pos >= floor:
                    self._gpu.pop(block_id, None)

    def position_tag(
        self, gpu_pool: GpuPoolView, gpu_block_id: int, pos: int, recovered: bool, tag_of: TagOf
    ) -> tuple[Key, Tag] | None:
        """Return (key, tag) to record for a request's block at `pos`, or None.

        A block recovered from the GPU cache (a sliding window had dropped it) may be
        another request's fill: only a tag noted for that fill applies.
        """
        key = gpu_pool.key(gpu_block_id)
        if key is None:
            return None
        tag = self.noted(gpu_block_id, key) if recovered else tag_of(pos, gpu_block_id, key)
        return None if tag is None else (key, tag)

    def of_block(
        self, request_id: str, gpu_pool: GpuPoolView, gpu_block_id: int
    ) -> tuple[Key, Tag] | None:
        """Return (key, tag) of a GPU block a request handed off, if its tags know the
        block's hash unambiguously (once the request was scheduled after computing it).

        A hand-off names no position, so a state block the request shared through the GPU
        prefix cache is tagged as its own: the check then rests on the block hash there.
        """
        key = gpu_pool.key(gpu_block_id)
        chain = self._chains.get(request_id)
        if key is None or chain is None:
            return None
        tag = chain.by_hash.get(key_block_hash(key))
        return None if tag is None else (key, tag)

    def drop(self, request_id: str) -> None:
        """Forget a finished request's tags (its GPU blocks' fills stay noted)."""
        self._chains.pop(request_id, None)
        self._local.pop(request_id, None)

    def clear(self) -> None:
        """Forget every request's tags and every noted fill."""
        self._chains.clear()
        self._local.clear()
        self._gpu.clear()

    def __len__(self) -> int:
        return len(self._chains)
