"""Chained block hashing (SPEC §3).

The hash of hash block *i* is ``H(parent, token ids of the block, extra keys)`` where the
parent is the hash of block *i - 1*, or the seed-derived root hash for block 0. Equal
hashes therefore mean equal whole prefixes (up to hash collisions).

Canonical serialisation (format version 1; any change must change the golden test)::

    block message = parent                 digest-size bytes (root hash for block 0)
                  | u64 num_tokens | num_tokens * i64 token ids
                  | u64 num_extra_keys | extra keys, each encoded as below
    encoded int   = b"i" | i64
    encoded str   = b"s" | u64 byte length | utf-8 bytes
    encoded bytes = b"b" | u64 byte length | bytes
    encoded tuple = b"t" | u64 item count | encoded items

All integers are little-endian; i64 is signed, u64 unsigned. Every field is fixed-size,
length-prefixed or count-prefixed, so distinct inputs never share a message.

Hash functions (`HashAlgo`):

- ``sha256`` (default): ``sha256(block message)``, 32 bytes. The seed is public; without
  one it is `DEFAULT_SEED`, so hashes are stable across processes and machines (needed by
  a shared disk or remote tier).
- ``xxhash``: ``xxh3_128(block message, seed=s)``, 16 bytes, where the 64-bit xxh3 seed
  ``s`` is derived from the secret seed with sha256. The installed python-xxhash exposes
  only the 64-bit ``seed=`` argument (no custom secret), so the root hash is also derived
  from the whole secret: every chain starts from a 128-bit value an attacker cannot
  know. Without a seed a random per-process seed is used and a warning is logged; such
  hashes must never reach a tier shared with other processes. xxh3 is not a
  cryptographic hash: use sha256 where tenants may attack each other.

Root hash: ``sha256(b"kvtier-root-v1" | seed as an encoded bytes)``, truncated to the digest
size. A ``str`` seed is encoded as utf-8 first.

What goes into a block's extra keys is decided in `extra_keys` (re-exported here).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

import xxhash

from kvtier.core.extra_keys import (
    NO_EXTRAS,
    ExtraKey,
    MultiModalItem,
    RequestExtras,
    extra_keys_for_block,
)
from kvtier.core.keys import BlockHash

__all__ = [
    "DEFAULT_SEED",
    "NO_EXTRAS",
    "BlockHasher",
    "ExtraKey",
    "HashAlgo",
    "MultiModalItem",
    "RequestExtras",
    "RequestHasher",
    "coarse_hashes",
    "encode_extra_key",
    "extra_keys_for_block",
    "hash_request",
]

logger = logging.getLogger(__name__)

DEFAULT_SEED: Final = b"kvtier-v1"
"""The sha256 seed used when none is configured (public, fixed: hashes are portable)."""

_ROOT_LABEL: Final = b"kvtier-root-v1"
_XXH3_SEED_LABEL: Final = b"kvtier-xxh3-seed-v1"
# Generated once at import: every unseeded xxhash hasher of this process shares it.
_PROCESS_SEED: Final = os.urandom(32)

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1


class HashAlgo(Enum):
    """Block hash function."""

    SHA256 = "sha256"
    XXHASH = "xxhash"


def encode_extra_key(value: ExtraKey, out: bytearray) -> None:
    """Append the canonical encoding of one extra key to `out` (format in the module doc).

    Raises TypeError for an unsupported type (bool included), ValueError outside int64.
    """
    # bool is an int subclass; True and 1 would serialise alike, so refuse it.
    if isinstance(value, bool):
        raise TypeError(f"extra key {value!r}: bool is not a valid extra key")
    if isinstance(value, int):
        if not _I64_MIN <= value <= _I64_MAX:
            raise ValueError(f"extra key {value} is outside the int64 range")
        out += b"i"
        out += _I64.pack(value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"s"
        out += _U64.pack(len(data))
        out += data
    elif isinstance(value, bytes):
        out += b"b"
        out += _U64.pack(len(value))
        out += value
    elif isinstance(value, tuple):
        out += b"t"
        out += _U64.pack(len(value))
        for item in value:
            encode_extra_key(item, out)
    else:
        raise TypeError(
            f"extra key {value!r} has type {type(value).__name__}; "
            "expected str, int, bytes or tuple"
        )


def _seed_bytes(seed: str | bytes) -> bytes:
    if not isinstance(seed, str | bytes):
        raise TypeError(f"hash seed has type {type(seed).__name__}; expected str or bytes")
    data = seed.encode("utf-8") if isinstance(seed, str) else seed
    if not data:
        raise ValueError("hash seed must not be empty")
    return data


def _derive(label: bytes, secret: bytes) -> bytes:
    out = bytearray(label)
    encode_extra_key(secret, out)
    return hashlib.sha256(out).digest()


@dataclass(frozen=True)
class BlockHasher:
    """Hash full hash blocks into chained block hashes.

    `seed` is public for sha256 (default `DEFAULT_SEED`) and a secret for xxhash (default:
    a random per-process seed, with a warning). Immutable and thread-safe.
    """

    hash_block_size: int
    algo: HashAlgo = HashAlgo.SHA256
    # Equality goes by the root hash, which stands for the effective seed.
    seed: str | bytes | None = field(default=None, repr=False, compare=False)
    _digest_size: int = field(init=False, repr=False, compare=False)
    _root_hash: BlockHash = field(init=False, repr=False)
    _xxh3_seed: int = field(init=False, repr=False, compare=False)
    _tokens_format: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.hash_block_size, bool) or not isinstance(self.hash_block_size, int):
            raise TypeError(f"hash_block_size {self.hash_block_size!r} is not an int")
        if self.hash_block_size < 1:
            raise ValueError(f"hash_block_size {self.hash_block_size} < 1")
        try:
            algo = HashAlgo(self.algo)
        except ValueError:
            choices = ", ".join(a.value for a in HashAlgo)
            raise ValueError(
                f"unknown hash algo {self.algo!r}; expected one of {choices}"
            ) from None
        object.__setattr__(self, "algo", algo)
        if self.seed is not None:
            secret = _seed_bytes(self.seed)
        elif algo is HashAlgo.SHA256:
            secret = DEFAULT_SEED
        else:
            logger.warning(
                "xxhash block hashing without a configured seed: using a random "
                "per-process seed; these hashes do not match other processes"
            )
            secret = _PROCESS_SEED
        digest_size = 32 if algo is HashAlgo.SHA256 else 16
        xxh3_seed = int.from_bytes(_derive(_XXH3_SEED_LABEL, secret)[:8], "little")
        object.__setattr__(self, "_digest_size", digest_size)
        object.__setattr__(self, "_root_hash", _derive(_ROOT_LABEL, secret)[:digest_size])
        object.__setattr__(self, "_xxh3_seed", xxh3_seed)
        object.__setattr__(self, "_tokens_format", f"<Q{self.hash_block_size}q")

    @property
    def digest_size(self) -> int:
        """Return the length in bytes of every block hash (32 sha256, 16 xxhash)."""
        return self._digest_size

    @property
    def root_hash(self) -> BlockHash:
        """Return the parent used for block 0, derived from the seed."""
        return self._root_hash

    def hash_block(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[ExtraKey, ...] = (),
    ) -> BlockHash:
        """Return the hash of one full hash block chained onto `parent`.

        `parent` is the previous block's hash, or None for block 0. Raises ValueError when
        `token_ids` is not exactly `hash_block_size` long, a token id is outside int64, or
        `parent` has the wrong length; TypeError for a `parent` that is not bytes,
        `extra_keys` that are not a tuple (or list) — a str would hash as the tuple of its
        characters — or an unsupported extra key.
        """
        if not isinstance(extra_keys, tuple | list):
            raise TypeError(
                f"extra keys {extra_keys!r} have type {type(extra_keys).__name__}; "
                "expected a tuple of extra keys"
            )
        if len(token_ids) != self.hash_block_size:
            raise ValueError(
                f"block has {len(token_ids)} token ids; "
                f"only full hash blocks of {self.hash_block_size} are hashed"
            )
        if parent is None:
            parent = self._root_hash
        elif not isinstance(parent, bytes):
            raise TypeError(
                f"parent hash {parent!r} has type {type(parent).__name__}; expected bytes"
            )
        elif len(parent) != self._digest_size:
            raise ValueError(
                f"parent hash has {len(parent)} bytes; {self.algo.value} hashes have "
                f"{self._digest_size}"
            )
        message = bytearray(parent)
        try:
            message += struct.pack(self._tokens_format, len(token_ids), *token_ids)
        except struct.error as exc:
            raise _BadTokenError(_bad_token_message(token_ids)) from exc
        message += _U64.pack(len(extra_keys))
        for key in extra_keys:
            encode_extra_key(key, message)
        if self.algo is HashAlgo.SHA256:
            return hashlib.sha256(message).digest()
        return bytes(xxhash.xxh3_128_digest(message, seed=self._xxh3_seed))


class _BadTokenError(ValueError):
    """A token id that is not an int64 (`RequestHasher` renames its position)."""


def _bad_token_message(token_ids: Sequence[int], start: int = 0) -> str:
    """Name the first bad token id; positions count from `start`."""
    for position, token in enumerate(token_ids, start):
        if not hasattr(token, "__index__"):
            return f"token id {token!r} at position {position} is not an int"
        if not _I64_MIN <= int(token) <= _I64_MAX:
            return f"token id {token} at position {position} is outside the int64 range"
    return f"cannot serialise token ids {list(token_ids)!r}"


class RequestHasher:
    """Hash one request's tokens incrementally as they arrive.

    Only full hash blocks are hashed; the partial tail stays buffered until a later
    `extend` completes it. Not thread-safe.
    """

    def __init__(self, hasher: BlockHasher, extras: RequestExtras = NO_EXTRAS) -> None:
        self._hasher = hasher
        self._extras = extras
        self._tail: list[int] = []
        self._block_hashes: list[BlockHash] = []

    @property
    def hasher(self) -> BlockHasher:
        """Return the block hasher in use."""
        return self._hasher

    @property
    def extras(self) -> RequestExtras:
        """Return the request's extras."""
        return self._extras

    def block_extra_keys(self, start: int, end: int) -> tuple[ExtraKey, ...]:
        """Return the extra keys of the tokens [start, end), a block of any size (`start`
        a multiple of its length): what an event about that block reports."""
        size = end - start
        if size < 1 or start < 0 or start % size:
            raise ValueError(f"tokens [{start}, {end}) are not a block")
        return extra_keys_for_block(self._extras, start // size, size)

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Return the hashes of all full blocks so far (a live view; do not mutate)."""
        return self._block_hashes

    @property
    def num_tokens(self) -> int:
        """Return the number of tokens seen so far, including the unhashed tail."""
        return len(self._block_hashes) * self._hasher.hash_block_size + len(self._tail)

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Append tokens; return the hashes of the blocks they completed, in order.

        Costs O(len(token_ids) + hash_block_size). A token id that is not an int in the
        int64 range raises ValueError naming it, and the hasher is left as it was (also
        for a bad id in the new partial tail, which is hashed only later).
        """
        size = self._hasher.hash_block_size
        pending = self._tail + list(token_ids)
        num_full = len(pending) // size
        tail = pending[num_full * size :]
        if tail:
            try:
                struct.pack(f"<{len(tail)}q", *tail)
            except struct.error as exc:
                start = (len(self._block_hashes) + num_full) * size
                raise ValueError(_bad_token_message(tail, start)) from exc
        new_hashes: list[BlockHash] = []
        parent = self._block_hashes[-1] if self._block_hashes else None
        first_index = len(self._block_hashes)
        for i in range(num_full):
            extra = extra_keys_for_block(self._extras, first_index + i, size)
            block = pending[i * size : (i + 1) * size]
            try:
                parent = self._hasher.hash_block(parent, block, extra)
            except _BadTokenError:  # name the position in the request, not in the block
                message = _bad_token_message(block, (first_index + i) * size)
                raise ValueError(message) from None
            new_hashes.append(parent)
        self._block_hashes.extend(new_hashes)  # only once every block hashed
        self._tail = tail
        return new_hashes

    def check_invariants(self) -> None:
        """Raise AssertionError when the internal state is inconsistent."""
        size = self._hasher.hash_block_size
        assert len(self._tail) < size, f"tail of {len(self._tail)} tokens is a full block"
        assert all(len(h) == self._hasher.digest_size for h in self._block_hashes)


def hash_request(
    hasher: BlockHasher, token_ids: Sequence[int], extras: RequestExtras = NO_EXTRAS
) -> list[BlockHash]:
    """Return the chained hashes of every full hash block of `token_ids`."""
    request_hasher = RequestHasher(hasher, extras)
    return request_hasher.extend(token_ids)


def coarse_hashes(fine_hashes: Sequence[BlockHash], ratio: int) -> list[BlockHash]:
    """Return the hashes of blocks `ratio` hash blocks long, viewed from fine hashes.

    Coarse block j uses fine hash ``(j + 1) * ratio - 1``; an incomplete trailing coarse
    block has no hash. Raises ValueError when `ratio` < 1.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, int):
        raise TypeError(f"ratio {ratio!r} is not an int")
    if ratio < 1:
        raise ValueError(f"ratio {ratio} < 1")
    return list(fine_hashes[ratio - 1 :: ratio])
