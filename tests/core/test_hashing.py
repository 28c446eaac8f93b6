"""Tests for kvtier.core.hashing (SPEC §3): chaining, incremental hashing, the coarse view."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest
from hashing_helpers import make_hasher
from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.core.hashing import (
    DEFAULT_SEED,
    BlockHasher,
    HashAlgo,
    MultiModalItem,
    RequestExtras,
    RequestHasher,
    coarse_hashes,
    hash_request,
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


@pytest.mark.parametrize("parent", [5, "x" * 32, bytearray(32)])
def test_hash_block_names_a_parent_that_is_not_bytes(parent: object) -> None:
    """Regression: an int parent raised "object of type 'int' has no len()", a str one
    "string argument without an encoding", naming neither."""
    hasher = make_hasher()
    with pytest.raises(TypeError, match=f"parent hash {re.escape(repr(parent))}"):
        hasher.hash_block(parent, [1, 2, 3, 4])  # type: ignore[arg-type]


@pytest.mark.parametrize("extra_keys", ["ab", b"ab", None, 7])
def test_hash_block_refuses_extra_keys_that_are_not_a_tuple(extra_keys: object) -> None:
    """Regression: a str or bytes given as the extra keys was hashed as the tuple of its
    items, so "ab" collided with ("a", "b") and b"ab" with (97, 98); None and an int
    raised "has no len()" naming nothing."""
    hasher = make_hasher()
    with pytest.raises(TypeError, match=f"extra keys {re.escape(repr(extra_keys))}"):
        hasher.hash_block(None, [1, 2, 3, 4], extra_keys)  # type: ignore[arg-type]
    keys = ("a", "b")
    assert hasher.hash_block(None, [1, 2, 3, 4], list(keys)) == hasher.hash_block(  # type: ignore[arg-type]
        None, [1, 2, 3, 4], keys
    )


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


def test_request_hasher_names_a_bad_token_s_position_in_the_request() -> None:
    """Not its position in the block (regression: 'x' at 5 was named at 1), and the
    hasher is left as it was."""
    request = RequestHasher(make_hasher())
    request.extend([1, 2, 3])
    with pytest.raises(ValueError, match="token id 'x' at position 5 is not an int"):
        request.extend([4, 5, "x", 7, 8])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=f"token id {2**63} at position 9 is outside"):
        request.extend([4, 5, 6, 7, 8, 9, 2**63])  # the new partial tail
    assert request.num_tokens == 3
    request.check_invariants()


@settings(max_examples=scaled_examples(60), deadline=None)
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


@pytest.mark.parametrize(
    "bad", [[3, 4, 5, 6, 7, None], [3, None], [3, 4, 2**63]], ids=["in-a-block", "tail", "int64"]
)
def test_a_refused_extend_changes_nothing(bad: list[object]) -> None:
    """SPEC §3: equal hashes mean equal prefixes. Regression: a refused extend kept the
    hashes of the blocks before the bad token but not the new tail, so a retry hashed
    [1, 2, 3, 4] again as block 1: the key of the different prompt [1, 2, 3, 4] * 2."""
    hasher = BlockHasher(4)
    request = RequestHasher(hasher)
    request.extend([1, 2])
    with pytest.raises(ValueError, match="token id"):
        request.extend(bad)  # type: ignore[arg-type]
    assert request.num_tokens == 2
    request.extend([3, 4, 5, 6, 7, 8])
    assert list(request.block_hashes) == hash_request(hasher, [1, 2, 3, 4, 5, 6, 7, 8])
    request.check_invariants()
