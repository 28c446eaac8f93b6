"""Keys: a block hash tagged with its KV group (core/keys.py)."""

from __future__ import annotations

import pytest

from kvtier.core.keys import key_block_hash, key_group_id, key_suffix, make_key


@pytest.mark.parametrize("group_id", [0, 1, 255, 256, 2**32 - 1])
def test_a_key_is_its_hash_and_its_group_suffix(group_id: int) -> None:
    block_hash = bytes(range(32))
    key = make_key(block_hash, group_id)
    assert key == block_hash + key_suffix(group_id)  # what the prefix scan relies on
    assert key_block_hash(key) == block_hash
    assert key_group_id(key) == group_id


@pytest.mark.parametrize("group_id", [-1, 2**32])
def test_a_group_id_out_of_range_is_refused(group_id: int) -> None:
    with pytest.raises(ValueError, match=f"group id {group_id} out of range"):
        key_suffix(group_id)


@pytest.mark.parametrize("group_id", [True, 1.5, "1", None])
def test_a_group_id_that_is_not_an_int_is_refused_naming_it(group_id: object) -> None:
    """A bool was taken as group 1; a float got past the range check (regression)."""
    with pytest.raises(TypeError, match=f"group id must be an int, got {group_id!r}"):
        make_key(bytes(32), group_id)  # type: ignore[arg-type]


def test_a_block_hash_that_is_not_bytes_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match="block hash must be bytes, got 'abc'"):
        make_key("abc", 0)  # type: ignore[arg-type]


def test_a_numpy_group_id_is_an_int() -> None:
    np = pytest.importorskip("numpy")
    assert make_key(bytes(32), np.int64(3)) == make_key(bytes(32), 3)
