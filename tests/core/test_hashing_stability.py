"""Tests for kvtier.core.hashing (SPEC §3): stable hash values and xxhash seeding.

Golden values, the documented SHA-256 format, the same hashes in another process and after
pickling; xxhash seeds, and the random per-process seed used without one.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import subprocess
import sys

import pytest
from hashing_helpers import make_hasher

from kvtier.core.hashing import HashAlgo, MultiModalItem, RequestExtras, hash_request

HASHING_LOGGER = "kvtier.core.hashing"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )


# --- stability ----------------------------------------------------------------------

GOLDEN_TOKENS = list(range(8))
GOLDEN_PLAIN = [
    "d90cdbdf9f62242770fc2f89dd24b88f86e322e76f4561584d3f373fdc93f242",
    "889071f5eae029966919bf78f09171ad05b30b58135f8d63caee91f67fb6c2c0",
]
GOLDEN_EXTRAS = RequestExtras(
    lora_name="adapter",
    mm_items=(MultiModalItem("img-1", 3, 2),),
    cache_salt="tenant",
    prompt_embeds_digest=b"\x01\x02",
)
GOLDEN_WITH_EXTRAS = [
    "93cce24cb72e985ec46955d169199a31989612b86f9ecb9694e9db6c39dc0163",
    "57ce8d0c7817e3e10b9175b4449afe4cddefa5e2115af09dc44f594cea0fd25c",
]


def test_golden_sha256_values() -> None:
    hasher = make_hasher()
    assert [h.hex() for h in hash_request(hasher, GOLDEN_TOKENS)] == GOLDEN_PLAIN
    assert [h.hex() for h in hash_request(hasher, GOLDEN_TOKENS, GOLDEN_EXTRAS)] == (
        GOLDEN_WITH_EXTRAS
    )


def test_sha256_matches_the_documented_format() -> None:
    def u64(n: int) -> bytes:
        return n.to_bytes(8, "little")

    def string(tag: bytes, data: bytes) -> bytes:
        return tag + u64(len(data)) + data

    root = hashlib.sha256(b"kvtier-root-v1" + string(b"b", b"kvtier-v1")).digest()
    tokens = b"".join(t.to_bytes(8, "little", signed=True) for t in (5, -1, 0, 7))
    extra = b"t" + u64(2) + string(b"s", b"mm") + b"i" + (-3).to_bytes(8, "little", signed=True)
    message = root + u64(4) + tokens + u64(1) + extra
    hasher = make_hasher()
    assert hasher.root_hash == root
    assert hasher.hash_block(None, [5, -1, 0, 7], (("mm", -3),)) == hashlib.sha256(message).digest()


def test_sha256_hashes_are_stable_across_processes() -> None:
    code = (
        "from kvtier.core.hashing import BlockHasher, hash_request\n"
        "print(' '.join(h.hex() for h in hash_request(BlockHasher(4), range(40))))\n"
    )
    other = run_python(code).stdout.split()
    assert other == [h.hex() for h in hash_request(make_hasher(), range(40))]


def test_hasher_pickles_with_its_seed() -> None:
    for hasher in (make_hasher(), make_hasher(algo=HashAlgo.XXHASH, seed="k")):
        copy = pickle.loads(pickle.dumps(hasher))
        assert copy == hasher
        assert hash_request(copy, range(8)) == hash_request(hasher, range(8))


# --- xxhash -------------------------------------------------------------------------


def test_xxhash_seeds() -> None:
    tokens = list(range(16))
    a1 = hash_request(make_hasher(algo=HashAlgo.XXHASH, seed="a"), tokens)
    a2 = hash_request(make_hasher(algo=HashAlgo.XXHASH, seed=b"a"), tokens)
    b = hash_request(make_hasher(algo=HashAlgo.XXHASH, seed="b"), tokens)
    assert a1 == a2
    assert not set(a1) & set(b)


def test_xxhash_without_seed_warns_and_shares_a_process_seed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=HASHING_LOGGER):
        first = make_hasher(algo=HashAlgo.XXHASH)
    assert any("random per-process seed" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger=HASHING_LOGGER):
        caplog.clear()
        make_hasher(algo=HashAlgo.SHA256)
        make_hasher(algo=HashAlgo.XXHASH, seed="k")
    assert not caplog.records
    second = make_hasher(algo=HashAlgo.XXHASH)
    assert first == second
    assert hash_request(first, range(8)) == hash_request(second, range(8))


def test_xxhash_random_seed_differs_between_processes() -> None:
    code = (
        "from kvtier.core.hashing import BlockHasher, HashAlgo, hash_request\n"
        "hasher = BlockHasher(4, HashAlgo.XXHASH)\n"
        "print(' '.join(h.hex() for h in hash_request(hasher, range(8))))\n"
    )
    result = run_python(code)
    assert "random per-process seed" in result.stderr
    mine = [h.hex() for h in hash_request(make_hasher(algo=HashAlgo.XXHASH), range(8))]
    assert not set(result.stdout.split()) & set(mine)


def test_seeded_xxhash_is_stable_across_processes_and_extras_separate_keys() -> None:
    """A configured xxhash seed gives every process the same hashes (a shared tier needs
    it); LoRA, multimodal items and salt still give different hashes there."""
    code = (
        "from kvtier.core.hashing import BlockHasher, HashAlgo, hash_request, RequestExtras\n"
        "hasher = BlockHasher(4, HashAlgo.XXHASH, seed='shared-secret')\n"
        "print(' '.join(h.hex() for h in hash_request(hasher, range(12))))\n"
    )
    result = run_python(code)
    assert "random per-process seed" not in result.stderr
    hasher = make_hasher(algo=HashAlgo.XXHASH, seed="shared-secret")
    plain = hash_request(hasher, range(12))
    assert result.stdout.split() == [h.hex() for h in plain]
    variants = [
        RequestExtras(lora_name="adapter"),
        RequestExtras(mm_items=(MultiModalItem("img", 2, 3),)),
        RequestExtras(cache_salt="tenant"),
        RequestExtras(prompt_embeds_digest=b"embeds"),
    ]
    seen = {tuple(plain)}
    for extras in variants:
        hashes = tuple(hash_request(hasher, range(12), extras))
        assert not set(hashes) & set(plain)
        seen.add(hashes)
    assert len(seen) == len(variants) + 1


def test_xxhash_and_sha256_hashes_do_not_chain_into_each_other() -> None:
    xx = make_hasher(algo=HashAlgo.XXHASH, seed="k")
    with pytest.raises(ValueError, match="parent hash has 32 bytes"):
        xx.hash_block(make_hasher().root_hash, [1, 2, 3, 4])
