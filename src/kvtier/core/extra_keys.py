"""Extra keys: what besides token ids decides whether two prefixes share KV (SPEC §3).

Per hash block, in order and only when present: the LoRA adapter name, each multimodal
item overlapping the block with its offset relative to the block start, the cache salt
(block 0 only), and a digest of the prompt embeddings. `hashing` serialises them.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import pairwise
from typing import Final, TypeAlias

ExtraKey: TypeAlias = "str | int | bytes | tuple[ExtraKey, ...]"
"""One extra key: nested tuples of str, int (int64 range, not bool) and bytes."""


@dataclass(frozen=True)
class MultiModalItem:
    """One multimodal input (image, audio, ...) occupying prompt positions.

    `identifier` names the item's content (e.g. a digest of its pixels); `offset` is the
    prompt position of its first placeholder token and `length` the number of positions.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str):
            raise TypeError(f"multimodal item identifier {self.identifier!r} is not a str")
        for name, value in (("offset", self.offset), ("length", self.length)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"multimodal item {self.identifier!r}: {name} {value!r} is not an int"
                )
        if self.offset < 0:
            raise ValueError(f"multimodal item {self.identifier!r}: offset {self.offset} < 0")
        if self.length < 1:
            raise ValueError(f"multimodal item {self.identifier!r}: length {self.length} < 1")

    @property
    def end(self) -> int:
        """Return the position just past the item's last placeholder token."""
        return self.offset + self.length


@dataclass(frozen=True)
class RequestExtras:
    """Everything besides token ids that decides whether two prefixes share KV.

    `mm_items` must be sorted by offset and must not overlap. `prompt_embeds_digest` is a
    digest of the whole prompt's embeddings, mixed into every block: requests share cache
    only when their entire prompt embeddings are equal.
    """

    lora_name: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    cache_salt: str | None = None
    prompt_embeds_digest: bytes | None = None

    def __post_init__(self) -> None:
        for name, value, kind in (
            ("lora_name", self.lora_name, str),
            ("cache_salt", self.cache_salt, str),
            ("prompt_embeds_digest", self.prompt_embeds_digest, bytes),
        ):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} {value!r} is not a {kind.__name__} or None")
        if not isinstance(self.mm_items, tuple | list):
            raise TypeError(f"mm_items must be a tuple of MultiModalItem, got {self.mm_items!r}")
        object.__setattr__(self, "mm_items", tuple(self.mm_items))  # frozen and hashable
        for item in self.mm_items:
            if not isinstance(item, MultiModalItem):
                raise TypeError(f"mm_items holds {item!r}, not a MultiModalItem")
        for before, after in pairwise(self.mm_items):
            if after.offset < before.end:
                raise ValueError(
                    f"multimodal items must be sorted and disjoint: {after!r} starts "
                    f"before {before!r} ends"
                )


NO_EXTRAS: Final = RequestExtras()
"""Extras of a plain request: no LoRA, no multimodal items, no salt, no embeddings."""


def extra_keys_for_block(
    extras: RequestExtras, block_index: int, hash_block_size: int
) -> tuple[ExtraKey, ...]:
    """Return the extra keys of hash block `block_index`, in SPEC §3 order.

    Each key is a tuple tagged with its kind, so e.g. a LoRA name never collides with an
    equal cache salt: ``("lora", name)``, ``("mm", identifier, offset relative to the
    block start)`` per item overlapping the block (the offset is negative when the item
    began in an earlier block), ``("salt", cache_salt)`` in block 0 only, and
    ``("embeds", digest)``.
    """
    if block_index < 0:
        raise ValueError(f"block index {block_index} < 0")
    if hash_block_size < 1:
        raise ValueError(f"hash_block_size {hash_block_size} < 1")
    start = block_index * hash_block_size
    end = start + hash_block_size
    keys: list[ExtraKey] = []
    if extras.lora_name is not None:
        keys.append(("lora", extras.lora_name))
    items = extras.mm_items
    # Items are sorted and disjoint, so their ends are sorted too.
    index = bisect_right(items, start, key=lambda item: item.end)
    while index < len(items) and items[index].offset < end:
        item = items[index]
        keys.append(("mm", item.identifier, item.offset - start))
        index += 1
    if extras.cache_salt is not None and block_index == 0:
        keys.append(("salt", extras.cache_salt))
    if extras.prompt_embeds_digest is not None:
        keys.append(("embeds", extras.prompt_embeds_digest))
    return tuple(keys)
