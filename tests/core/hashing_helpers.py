"""Helpers for the kvtier.core.hashing tests (SPEC §3)."""

from __future__ import annotations

from kvtier.core.hashing import BlockHasher, HashAlgo


def make_hasher(
    hash_block_size: int = 4, algo: HashAlgo = HashAlgo.SHA256, seed: str | bytes | None = None
) -> BlockHasher:
    return BlockHasher(hash_block_size, algo, seed)
