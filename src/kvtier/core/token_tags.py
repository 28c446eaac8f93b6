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
from collections.abc import Sequence
from typing import Final

from kvtier.core.hashing import encode_extra_key

Tag = bytes

TAG_SIZE: Final = 16
TAG_ROOT: Final = hashlib.blake2b(b"kvtier-tag-root-v1", digest_size=TAG_SIZE).digest()
_PERSON: Final = b"kvtier-tag-v1"
_BASE: Final = hashlib.blake2b(digest_size=TAG_SIZE, person=_PERSON)  # copied per tag
_U64 = struct.Struct("<Q")


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


@functools.lru_cache(maxsize=8)
def _tokens_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<Q{num_tokens}q")
