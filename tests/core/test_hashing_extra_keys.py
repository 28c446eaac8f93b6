"""Tests for kvtier.core.hashing (SPEC §3): serialisation and per-block extra keys.

Token and extra-key serialisation is unambiguous; LoRA name, multimodal items, cache salt
and prompt-embeds digest enter the blocks they apply to, in spec order.
"""

from __future__ import annotations

import pytest
from hashing_helpers import make_hasher
from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.core.hashing import (
    MultiModalItem,
    RequestExtras,
    RequestHasher,
    extra_keys_for_block,
    hash_request,
)

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


@settings(max_examples=scaled_examples(60), deadline=None)
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


@pytest.mark.parametrize(
    ("identifier", "offset", "length", "named"),
    [
        ("a", 1.0, 2, "offset 1.0"),
        ("a", True, 2, "offset True"),
        ("a", 0, 2.5, "length 2.5"),
        (b"digest", 0, 2, "identifier b'digest'"),
        (7, 0, 2, "identifier 7"),
    ],
)
def test_multimodal_item_fields_must_have_their_types(
    identifier: object, offset: object, length: object, named: str
) -> None:
    """A float offset used to pass and fail later, at hashing, without naming the item."""
    with pytest.raises(TypeError, match=named):
        MultiModalItem(identifier, offset, length)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [("lora_name", 7), ("cache_salt", b"salt"), ("prompt_embeds_digest", "digest")],
)
def test_request_extras_fields_must_have_their_types(field: str, value: object) -> None:
    """An int LoRA name would hash unlike its str; every field's type is checked."""
    with pytest.raises(TypeError, match=f"{field} {value!r}"):
        RequestExtras(**{field: value})  # type: ignore[arg-type]


def test_request_extras_mm_items_become_a_tuple_of_items() -> None:
    """A list of items is kept as a tuple (extras stay hashable); other entries are refused."""
    item = MultiModalItem("a", 0, 2)
    extras = RequestExtras(mm_items=[item])  # type: ignore[arg-type]
    assert extras.mm_items == (item,)
    assert hash(extras) == hash(RequestExtras(mm_items=(item,)))
    with pytest.raises(TypeError, match="'a', not a MultiModalItem"):
        RequestExtras(mm_items=("a",))  # type: ignore[arg-type]


def test_prompt_embeds_digest_applies_to_every_block() -> None:
    hasher = make_hasher()
    tokens = list(range(12))
    a = hash_request(hasher, tokens, RequestExtras(prompt_embeds_digest=b"a"))
    b = hash_request(hasher, tokens, RequestExtras(prompt_embeds_digest=b"b"))
    assert all(x != y for x, y in zip(a, b, strict=True))
    extras = RequestExtras(prompt_embeds_digest=b"a")
    assert all(extra_keys_for_block(extras, i, 4) == (("embeds", b"a"),) for i in range(3))


# --- extra keys of a block, for events ---------------------------------------------


def test_block_extra_keys_name_what_enters_each_block_of_any_size() -> None:
    extras = RequestExtras(
        lora_name="adapter", mm_items=(MultiModalItem("img", 20, 8),), cache_salt="tenant"
    )
    hasher = RequestHasher(make_hasher(4), extras)
    assert hasher.block_extra_keys(0, 16) == (("lora", "adapter"), ("salt", "tenant"))
    assert hasher.block_extra_keys(16, 32) == (("lora", "adapter"), ("mm", "img", 4))
    assert hasher.block_extra_keys(24, 28) == (("lora", "adapter"), ("mm", "img", -4))
    assert hasher.block_extra_keys(32, 48) == (("lora", "adapter"),)
    assert RequestHasher(make_hasher(4)).block_extra_keys(0, 4) == ()


@pytest.mark.parametrize(("start", "end"), [(4, 12), (8, 8), (-16, 0)])
def test_block_extra_keys_refuse_a_range_that_is_not_a_block(start: int, end: int) -> None:
    with pytest.raises(ValueError, match=rf"\[{start}, {end}\) are not a block"):
        RequestHasher(make_hasher(4)).block_extra_keys(start, end)


@pytest.mark.parametrize(
    ("block_index", "hash_block_size", "message"),
    [(-1, 16, "block index -1 < 0"), (0, 0, "hash_block_size 0 < 1")],
)
def test_extra_keys_for_block_refuse_a_block_before_the_prompt_or_of_no_tokens(
    block_index: int, hash_block_size: int, message: str
) -> None:
    """Block -1 would start before the prompt, and blocks of 0 tokens would all start at
    position 0: both name the bad value (a mutation run, s32, found neither check tested)."""
    extras = RequestExtras(mm_items=(MultiModalItem("img", 0, 4),))
    with pytest.raises(ValueError, match=message):
        extra_keys_for_block(extras, block_index, hash_block_size)
