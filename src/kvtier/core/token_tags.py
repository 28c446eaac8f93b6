"""Token tags: a second chained digest that checks a hit's tokens (SPEC §3 **Beyond**).

A block hash says "same prefix" only up to hash collisions. With the token check on, each
lower-tier slot also holds the *tag* of what was copied into it, and a hit counts only
where the slot's tag equals the tag the looking-up request computes from its own tokens.
A collision of the block hash then costs a miss, never wrong KV.

The tag of hash block *i* chains like the block hash but with an independent function::

    tag(i) = blake2b-128(tag(i - 1) or TAG_ROOT | u64 n | n * i64 token ids
                         | u64 num_extra_keys | extra keys, encoded as `hashing` does)

keyed by the personalisation `b"kvtier-tag-v1"`. Extra keys an engine gives in a form
`hashing` cannot encode (vLLM's own objects) are encoded by their `repr`, which is
deterministic for the str/int/bytes/tuple values engines use.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Final

from kvtier.core.hashing import encode_extra_key

Tag = bytes

TAG_SIZE: Final = 16
TAG_ROOT: Final = hashlib.blake2b(b"kvtier-tag-root-v1", digest_size=TAG_SIZE).digest()
_PERSON: Final = b"kvtier-tag-v1"
_BASE: Final = hashlib.blake2b(digest_size=TAG_SIZE, person=_PERSON)  # copied per tag
_U64 = struct.Struct("<Q")
_NO_EXTRA_KEYS: Final = _U64.pack(0)


def _encode_any(value: object, out: bytearray) -> None:
    start = len(out)
    try:
        encode_extra_key(value, out)  # type: ignore[arg-type]  # checked by the callee
    except (TypeError, ValueError):
        del out[start:]
        encode_extra_key(f"repr:{value!r}", out)


def token_tag(parent: Tag | None, token_ids: Sequence[int], extra_keys: Sequence[object]) -> Tag:
    """Return the tag of one hash block chained onto `parent` (None for block 0).

    Raises ValueError when a token id is not an int64.
    """
    try:
        tokens = _tokens_struct(len(token_ids)).pack(len(token_ids), *token_ids)
    except struct.error as error:
        raise ValueError(f"token ids {list(token_ids)[:8]!r}...: not int64 ({error})") from None
    tail = bytearray(_U64.pack(len(extra_keys)))
    for key in extra_keys:
        _encode_any(key, tail)
    digest = _BASE.copy()
    digest.update((TAG_ROOT if parent is None else parent) + tokens + tail)
    return digest.digest()


def chain_tags(
    parent: Tag | None,
    token_ids: Sequence[int],
    block_size: int,
    first: int,
    end: int,
    extra_keys: Callable[[int, int], Sequence[object]],
) -> list[Tag]:
    """Return the tags of hash blocks `first .. end - 1` of `token_ids`, chained onto
    `parent` (block `first - 1`'s tag, None for block 0): what `token_tag` returns block
    by block, in one loop. `extra_keys(start, end)` gives a block's extra keys.

    Raises ValueError when a token id is not an int64, or `token_ids` ends before block
    `end - 1` does (its tag would cover fewer tokens than the block holds).
    """
    if len(token_ids) < end * block_size:
        raise ValueError(
            f"{len(token_ids)} token ids do not fill hash blocks up to {end} of {block_size} tokens"
        )
    span = token_ids[first * block_size : end * block_size]
    try:
        values = array("q", span)
    except (OverflowError, TypeError) as error:
        raise ValueError(f"token ids {list(span)[:8]!r}...: not int64 ({error})") from None
    if sys.byteorder != "little":
        values.byteswap()
    raw = values.tobytes()
    width = 8 * block_size
    count = _U64.pack(block_size)
    tags: list[Tag] = []
    previous = TAG_ROOT if parent is None else parent
    for k, start in enumerate(range(first * block_size, end * block_size, block_size)):
        extra = extra_keys(start, start + block_size)
        if extra:
            previous = token_tag(previous, token_ids[start : start + block_size], extra)
        else:
            digest = _BASE.copy()
            digest.update(previous + count + raw[k * width : (k + 1) * width] + _NO_EXTRA_KEYS)
            previous = digest.digest()
        tags.append(previous)
    return tags


@functools.lru_cache(maxsize=8)
def _tokens_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<Q{num_tokens}q")
