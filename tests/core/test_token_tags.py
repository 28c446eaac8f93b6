"""Token tags (SPEC §3 Beyond): the second digest, and the pool keeping one per primary key."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import make_key
from kvtier.core.token_tags import TAG_SIZE, chain_tags, token_tag


def key(i: int) -> bytes:
    return make_key(hashlib.sha256(str(i).encode()).digest(), 0)


def test_a_tag_chains_over_tokens_extra_keys_and_parent() -> None:
    root = token_tag(None, [1, 2, 3, 4], ())
    assert len(root) == TAG_SIZE
    assert root == token_tag(None, [1, 2, 3, 4], ())
    variants = {
        token_tag(None, [1, 2, 3, 5], ()),
        token_tag(None, [1, 2, 3, 4], ("lora-a",)),
        token_tag(None, [1, 2, 3, 4], (("img", 0),)),
        token_tag(root, [1, 2, 3, 4], ()),
        token_tag(None, [1, 2, 3], ()),
    }
    assert root not in variants
    assert len(variants) == 5
    child = token_tag(root, [5, 6, 7, 8], ())
    other_parent = token_tag(token_tag(None, [9, 2, 3, 4], ()), [5, 6, 7, 8], ())
    assert child != other_parent  # a block's tag covers its whole prefix


def test_the_tag_is_not_the_block_hash_function() -> None:
    """Independent of sha256 block hashes: a collision of one says nothing of the other."""
    assert token_tag(None, [1, 2], ()) != hashlib.sha256(b"").digest()[:TAG_SIZE]
    assert hashlib.blake2b(digest_size=TAG_SIZE).digest() != token_tag(None, [], ())


def test_extra_keys_of_an_engine_s_own_types_are_tagged_by_repr() -> None:
    """vLLM hands its own objects; they must tag deterministically, and tell apart."""

    class Opaque:
        def __init__(self, name: str) -> None:
            self.name = name

        def __repr__(self) -> str:
            return f"Opaque({self.name})"

    a = token_tag(None, [1], (Opaque("a"), True))
    assert a == token_tag(None, [1], (Opaque("a"), True))
    assert a != token_tag(None, [1], (Opaque("b"), True))
    assert a != token_tag(None, [1], (Opaque("a"), False))
    assert token_tag(None, [1], ("x",)) != token_tag(None, [1], ("repr:'x'",))


def test_a_key_refused_part_way_is_tagged_by_its_repr_alone() -> None:
    """A tuple whose encoding fails after its first items is tagged as its repr, without
    the bytes already written for those items (a mutation run, s32, left them in with
    every test passing)."""
    assert token_tag(None, [1], ((7, "a", True),)) == token_tag(None, [1], ("repr:(7, 'a', True)",))


def test_a_token_outside_int64_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="not int64"):
        token_tag(None, [2**63], ())


def tagged_pool() -> BlockPool:
    pool = BlockPool(4)
    pool.allocate(3)
    pool.insert_key(key(1), 1, 4, tag=b"t1")
    pool.insert_keys([key(2), key(3)], [2, 3], [4, 4], tags={1: b"t3"})
    pool.free([1, 2, 3])
    return pool


def test_the_pool_keeps_a_tag_with_its_primary_key_only() -> None:
    pool = tagged_pool()
    assert [pool.tag(b) for b in (1, 2, 3)] == [b"t1", None, b"t3"]
    pool.insert_key(key(9), 1, 4, tag=b"secondary")  # a second key leaves the tag alone
    assert pool.tag(1) == b"t1"
    pool.check_invariants()


@pytest.mark.parametrize("how", ["evict", "discard", "reset"])
def test_a_tag_leaves_with_its_key(how: str) -> None:
    """A slot reused for other KV must never keep the tag of what it held before."""
    pool = tagged_pool()
    if how == "evict":
        (taken,) = pool.allocate(1)  # LRU: block 1, the oldest
        assert taken == 1
        pool.insert_key(key(1), 1, 4)  # the same key again, registered without a tag
    elif how == "discard":
        pool.discard_keys(1)
    else:
        assert pool.reset()
    assert pool.tag(1) is None
    pool.check_invariants()


def test_insert_keys_tags_only_blocks_whose_primary_key_it_set() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    pool.insert_key(key(1), 1, 4)
    pool.insert_keys([key(5), key(6)], [1, 2], [4, 4], tags={0: b"t5", 1: b"t6"})
    assert (pool.tag(1), pool.tag(2)) == (None, b"t6")  # key(5) became block 1's secondary
    pool.check_invariants()


def test_tags_are_stable_across_versions() -> None:
    """Golden values: persistent manifests keep tags, so the format must never drift."""
    first = token_tag(None, list(range(16)), ())
    second = token_tag(first, list(range(16, 32)), ("lora-a", ("img", 3), b"\x01", -5))
    assert first.hex() == "2205cfa39fee7b3f265f6dcdbad3d392"
    assert second.hex() == "73dc17240134d0fc5df8c42dbe884d56"


def test_chain_tags_is_token_tag_block_by_block() -> None:
    """The batched loop (the hot path without extra keys) agrees with `token_tag`."""
    tokens = list(range(100, 140))

    def extras(start: int, end: int) -> tuple[object, ...]:
        return ("salt",) if start == 8 else ()

    expected, parent = [], None
    for start in range(0, 40, 4):
        parent = token_tag(parent, tokens[start : start + 4], extras(start, start + 4))
        expected.append(parent)
    assert chain_tags(None, tokens, 4, 0, 10, extras) == expected
    assert chain_tags(expected[3], tokens, 4, 4, 10, extras) == expected[4:]
    with pytest.raises(ValueError, match="not int64"):
        chain_tags(None, [2**63] * 4, 4, 0, 1, extras)
    with pytest.raises(ValueError, match="39 token ids do not fill hash blocks up to 10 of 4"):
        chain_tags(None, tokens[:39], 4, 0, 10, extras)  # tagged a short block (regression)


def test_an_int_key_outside_int64_is_tagged_by_its_repr() -> None:
    """The block hash refuses such a key with ValueError, not TypeError: the tag falls back
    to the repr all the same (a token check must never fail a store). Mutant (s35): only
    TypeError caught passed every core test."""
    big = token_tag(None, [1], (2**70,))
    assert big == token_tag(None, [1], (f"repr:{2**70!r}",))
    assert big != token_tag(None, [1], (2**71,))


def test_chain_tags_asks_each_block_for_its_own_extra_keys() -> None:
    """`extra_keys(start, end)` gets each hash block's token range. Mutant (s35): an empty
    range passed every core test (their callables ignore the range)."""
    asked: list[tuple[int, int]] = []

    def extras(start: int, end: int) -> tuple[object, ...]:
        asked.append((start, end))
        return ("salt",) if start == 0 else ()

    tags = chain_tags(None, list(range(12)), 4, 0, 3, extras)
    assert asked == [(0, 4), (4, 8), (8, 12)]
    assert tags[0] == token_tag(None, [0, 1, 2, 3], ("salt",))


def test_chain_tags_refuses_a_token_that_is_no_int_naming_it() -> None:
    """Mutant (s35): a TypeError (a float token) escaped unconverted."""
    with pytest.raises(ValueError, match="not int64"):
        chain_tags(None, [1, 2, 3, 4.5], 4, 0, 1, lambda start, end: ())
