"""Tests for kvtier.core.hashing (SPEC §3)."""

from __future__ import annotations

import hashlib
import logging
import pickle
import subprocess
import sys
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.hashing import (
    DEFAULT_SEED,
    BlockHasher,
    HashAlgo,
    MultiModalItem,
    RequestExtras,
    RequestHasher,
    coarse_hashes,
    extra_keys_for_block,
    hash_request,
)

HASHING_LOGGER = "kvtier.core.hashing"


def make_hasher(
    hash_block_size: int = 4, algo: HashAlgo = HashAlgo.SHA256, seed: str | bytes | None = None
) -> BlockHasher:
    return BlockHasher(hash_block_size, algo, seed)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )


# --- chaining -----------------------------------------------------------------------


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_digest_sizes(algo: HashAlgo) -> None:
    hasher = make_hasher(algo=algo, seed="s")
    expected = 32 if algo is HashAlgo.SHA256 else 16
    assert hasher.digest_size == expected
    assert len(hasher.root_hash) == expected
    assert all(len(h) == expected for h in hash_request(hasher, range(12)))


def test_equal_prefixes_give_equal_hashes() -> None:
    hasher = make_hasher()
    a = hash_request(hasher, [*range(8), 100, 101, 102, 103])
    b = hash_request(hasher, [*range(8), 200, 201, 202, 203])
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_changing_a_token_in_block_0_changes_every_later_hash() -> None:
    hasher = make_hasher()
    tokens = list(range(20))
    changed = [*tokens]
    changed[1] = 999
    a, b = hash_request(hasher, tokens), hash_request(hasher, changed)
    assert len(a) == len(b) == 5
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_parent_matters() -> None:
    hasher = make_hasher()
    block = [1, 2, 3, 4]
    other_parent = hasher.hash_block(None, [9, 9, 9, 9])
    assert hasher.hash_block(None, block) != hasher.hash_block(other_parent, block)
    assert hasher.hash_block(None, block) == hasher.hash_block(hasher.root_hash, block)


def test_hash_block_rejects_partial_blocks() -> None:
    hasher = make_hasher()
    with pytest.raises(ValueError, match="3 token ids"):
        hasher.hash_block(None, [1, 2, 3])
    with pytest.raises(ValueError, match="5 token ids"):
        hasher.hash_block(None, [1, 2, 3, 4, 5])


def test_hash_block_rejects_bad_parent_and_tokens() -> None:
    hasher = make_hasher()
    with pytest.raises(ValueError, match="parent hash has 16 bytes"):
        hasher.hash_block(b"x" * 16, [1, 2, 3, 4])
    with pytest.raises(ValueError, match=f"token id {2**63} at position 2"):
        hasher.hash_block(None, [1, 2, 2**63, 4])
    with pytest.raises(ValueError, match="token id 'a' at position 0"):
        hasher.hash_block(None, ["a", 2, 3, 4])  # type: ignore[list-item]


def test_hasher_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="hash_block_size 0"):
        BlockHasher(0)
    with pytest.raises(ValueError, match="unknown hash algo 'md5'"):
        BlockHasher(4, "md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        BlockHasher(4, seed="")
    with pytest.raises(TypeError, match="int"):
        BlockHasher(4, seed=7)  # type: ignore[arg-type]


def test_algo_accepts_its_string_value() -> None:
    assert BlockHasher(4, "xxhash", "k").algo is HashAlgo.XXHASH  # type: ignore[arg-type]


def test_partial_tail_is_not_hashed() -> None:
    hasher = make_hasher()
    assert hash_request(hasher, range(3)) == []
    assert len(hash_request(hasher, range(11))) == 2
    assert hash_request(hasher, range(11)) == hash_request(hasher, range(8))


def test_default_seed_is_documented_constant() -> None:
    assert BlockHasher(4) == BlockHasher(4, seed=DEFAULT_SEED)
    assert BlockHasher(4) != BlockHasher(4, seed="other")
    assert hash_request(BlockHasher(4), range(8)) == hash_request(
        BlockHasher(4, seed=DEFAULT_SEED.decode()), range(8)
    )


# --- incremental hashing ------------------------------------------------------------


def test_request_hasher_extend_returns_newly_completed_blocks() -> None:
    request = RequestHasher(make_hasher())
    assert request.extend([1, 2, 3]) == []
    assert request.num_tokens == 3
    first = request.extend([4, 5])
    assert len(first) == 1
    assert request.num_tokens == 5
    more = request.extend(range(6, 14))
    assert len(more) == 2
    assert list(request.block_hashes) == first + more
    assert list(request.block_hashes) == hash_request(make_hasher(), [1, 2, 3, 4, 5, *range(6, 14)])
    request.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    hash_block_size=st.integers(1, 7),
)
def test_chunked_extend_equals_whole_request(
    tokens: list[int], cuts: list[int], hash_block_size: int
) -> None:
    hasher = make_hasher(hash_block_size)
    extras = RequestExtras(
        lora_name="l", mm_items=(MultiModalItem("img", 2, 5),), cache_salt="salt"
    )
    request = RequestHasher(hasher, extras)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    collected = []
    for start, end in pairwise(bounds):
        collected += request.extend(tokens[start:end])
        request.check_invariants()
        assert request.num_tokens == end
    expected = hash_request(hasher, tokens, extras)
    assert collected == expected
    assert list(request.block_hashes) == expected
    assert len(expected) == len(tokens) // hash_block_size


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


# --- serialisation ------------------------------------------------------------------


def test_token_serialisation_is_unambiguous() -> None:
    hasher = make_hasher(2)
    assert hasher.hash_block(None, [1, 23]) != hasher.hash_block(None, [12, 3])
    assert hasher.hash_block(None, [0, 1]) != hasher.hash_block(None, [1, 0])


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (("ab",), ("a", "b")),
        (("a", "b"), (("a", "b"),)),
        ((1,), ("1",)),
        ((b"x",), ("x",)),
        ((("a",), "b"), ("a", ("b",))),
        ((), ("",)),
        ((0,), ()),
    ],
)
def test_extra_key_serialisation_is_unambiguous(left: tuple, right: tuple) -> None:
    hasher = make_hasher()
    block = [1, 2, 3, 4]
    assert hasher.hash_block(None, block, left) != hasher.hash_block(None, block, right)


def test_extra_keys_reject_unsupported_values() -> None:
    hasher = make_hasher()
    with pytest.raises(TypeError, match="float"):
        hasher.hash_block(None, [1, 2, 3, 4], (1.5,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        hasher.hash_block(None, [1, 2, 3, 4], (True,))
    with pytest.raises(ValueError, match="int64"):
        hasher.hash_block(None, [1, 2, 3, 4], (2**64,))


# --- extra keys ---------------------------------------------------------------------


def test_cache_salt_isolates_tenants() -> None:
    hasher = make_hasher()
    tokens = list(range(16))
    a = hash_request(hasher, tokens, RequestExtras(cache_salt="a"))
    b = hash_request(hasher, tokens, RequestExtras(cache_salt="b"))
    plain = hash_request(hasher, tokens)
    assert not set(a) & set(b)
    assert not set(a) & set(plain)


def test_cache_salt_only_in_block_0_extra_keys() -> None:
    extras = RequestExtras(cache_salt="s")
    assert extra_keys_for_block(extras, 0, 4) == (("salt", "s"),)
    assert extra_keys_for_block(extras, 1, 4) == ()
    assert extra_keys_for_block(extras, 5, 4) == ()


def test_lora_name_changes_hashes() -> None:
    hasher = make_hasher()
    tokens = list(range(8))
    a = hash_request(hasher, tokens, RequestExtras(lora_name="a"))
    b = hash_request(hasher, tokens, RequestExtras(lora_name="b"))
    plain = hash_request(hasher, tokens)
    assert len({a[0], b[0], plain[0]}) == 3
    assert extra_keys_for_block(RequestExtras(lora_name="a"), 3, 4) == (("lora", "a"),)


def test_extra_keys_are_tagged_by_kind() -> None:
    hasher = make_hasher()
    tokens = list(range(4))
    assert hash_request(hasher, tokens, RequestExtras(lora_name="x")) != hash_request(
        hasher, tokens, RequestExtras(cache_salt="x")
    )


def test_extra_keys_follow_spec_order() -> None:
    extras = RequestExtras(
        lora_name="l",
        mm_items=(MultiModalItem("img", 1, 2),),
        cache_salt="s",
        prompt_embeds_digest=b"d",
    )
    assert extra_keys_for_block(extras, 0, 4) == (
        ("lora", "l"),
        ("mm", "img", 1),
        ("salt", "s"),
        ("embeds", b"d"),
    )
    assert extra_keys_for_block(extras, 1, 4) == (("lora", "l"), ("embeds", b"d"))


def test_multimodal_identity_and_offset_matter() -> None:
    hasher = make_hasher()
    tokens = list(range(8))

    def hashes(*items: MultiModalItem) -> list[bytes]:
        return hash_request(hasher, tokens, RequestExtras(mm_items=items))

    base = hashes(MultiModalItem("cat", 1, 2))
    assert hashes(MultiModalItem("dog", 1, 2))[0] != base[0]
    assert hashes(MultiModalItem("cat", 2, 2))[0] != base[0]
    assert hashes()[0] != base[0]
    # Same item at the same offset within block 1 as it had within block 0.
    shifted = hashes(MultiModalItem("cat", 5, 2))
    assert shifted[0] == hashes()[0]
    assert extra_keys_for_block(RequestExtras(mm_items=(MultiModalItem("cat", 5, 2),)), 1, 4) == (
        ("mm", "cat", 1),
    )


def test_multimodal_item_spanning_blocks_affects_exactly_those_blocks() -> None:
    # Blocks of 4: the item covers positions 6..13, i.e. blocks 1, 2, 3.
    extras = RequestExtras(mm_items=(MultiModalItem("video", 6, 8),))
    keys = [extra_keys_for_block(extras, i, 4) for i in range(5)]
    assert keys == [(), (("mm", "video", 2),), (("mm", "video", -2),), (("mm", "video", -6),), ()]

    hasher = make_hasher()
    tokens = list(range(20))
    with_item = hash_request(hasher, tokens, extras)
    plain = hash_request(hasher, tokens)
    assert with_item[0] == plain[0]
    assert all(a != b for a, b in zip(with_item[1:], plain[1:], strict=True))


def test_multimodal_item_boundaries() -> None:
    # An item ending exactly at a block start does not touch that block.
    extras = RequestExtras(
        mm_items=(MultiModalItem("a", 0, 4), MultiModalItem("b", 4, 1), MultiModalItem("c", 7, 3))
    )
    assert extra_keys_for_block(extras, 0, 4) == (("mm", "a", 0),)
    assert extra_keys_for_block(extras, 1, 4) == (("mm", "b", 0), ("mm", "c", 3))
    assert extra_keys_for_block(extras, 2, 4) == (("mm", "c", -1),)
    assert extra_keys_for_block(extras, 3, 4) == ()


@settings(max_examples=60, deadline=None)
@given(
    gaps_and_lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 9)), max_size=8),
    hash_block_size=st.integers(1, 6),
)
def test_multimodal_keys_match_a_naive_overlap_scan(
    gaps_and_lengths: list[tuple[int, int]], hash_block_size: int
) -> None:
    items, position = [], 0
    for number, (gap, length) in enumerate(gaps_and_lengths):
        items.append(MultiModalItem(f"item-{number}", position + gap, length))
        position += gap + length
    extras = RequestExtras(mm_items=tuple(items))
    for block_index in range(position // hash_block_size + 2):
        start, end = block_index * hash_block_size, (block_index + 1) * hash_block_size
        naive = tuple(
            ("mm", item.identifier, item.offset - start)
            for item in items
            if item.offset < end and item.offset + item.length > start
        )
        assert extra_keys_for_block(extras, block_index, hash_block_size) == naive


def test_multimodal_items_must_be_sorted_and_disjoint() -> None:
    with pytest.raises(ValueError, match="sorted and disjoint"):
        RequestExtras(mm_items=(MultiModalItem("a", 4, 2), MultiModalItem("b", 0, 2)))
    with pytest.raises(ValueError, match="sorted and disjoint"):
        RequestExtras(mm_items=(MultiModalItem("a", 0, 4), MultiModalItem("b", 3, 2)))
    with pytest.raises(ValueError, match="length 0"):
        MultiModalItem("a", 0, 0)
    with pytest.raises(ValueError, match="offset -1"):
        MultiModalItem("a", -1, 2)


def test_prompt_embeds_digest_applies_to_every_block() -> None:
    hasher = make_hasher()
    tokens = list(range(12))
    a = hash_request(hasher, tokens, RequestExtras(prompt_embeds_digest=b"a"))
    b = hash_request(hasher, tokens, RequestExtras(prompt_embeds_digest=b"b"))
    assert all(x != y for x, y in zip(a, b, strict=True))
    extras = RequestExtras(prompt_embeds_digest=b"a")
    assert all(extra_keys_for_block(extras, i, 4) == (("embeds", b"a"),) for i in range(3))


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


def test_xxhash_and_sha256_hashes_do_not_chain_into_each_other() -> None:
    xx = make_hasher(algo=HashAlgo.XXHASH, seed="k")
    with pytest.raises(ValueError, match="parent hash has 32 bytes"):
        xx.hash_block(make_hasher().root_hash, [1, 2, 3, 4])


# --- coarse view --------------------------------------------------------------------


def test_coarse_hashes() -> None:
    fine = [bytes([i]) for i in range(7)]
    assert coarse_hashes(fine, 1) == fine
    assert coarse_hashes(fine, 2) == [fine[1], fine[3], fine[5]]
    assert coarse_hashes(fine, 3) == [fine[2], fine[5]]
    assert coarse_hashes(fine, 7) == [fine[6]]
    assert coarse_hashes(fine, 8) == []
    assert coarse_hashes([], 2) == []
    with pytest.raises(ValueError, match="ratio 0"):
        coarse_hashes(fine, 0)


def test_coarse_hash_is_the_last_fine_hash_of_the_group_block() -> None:
    # A group block of 8 tokens over hash blocks of 4 covers the same prefix as fine hash 2j+1.
    tokens = list(range(24))
    fine = hash_request(make_hasher(4), tokens)
    assert coarse_hashes(fine, 2) == [fine[1], fine[3], fine[5]]
