"""Hashing edges a mutation run found untested (each test fails when its rule or check is
changed): an extra key at either end of the int64 range, and `RequestHasher`'s check of
its tail."""

from __future__ import annotations

import pytest

from kvtier.core.hashing import BlockHasher, RequestHasher


@pytest.mark.parametrize("value", [-(2**63), 2**63 - 1])
def test_an_extra_key_at_either_end_of_int64_is_hashed(value: int) -> None:
    """Both ends are int64 values and hash apart from their neighbour inside the range."""
    hasher = BlockHasher(2)
    inner = value + 1 if value < 0 else value - 1
    assert hasher.hash_block(None, [1, 2], (value,)) != hasher.hash_block(None, [1, 2], (inner,))


@pytest.mark.parametrize("value", [-(2**63) - 1, 2**63])
def test_an_extra_key_just_outside_int64_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="outside the int64 range"):
        BlockHasher(2).hash_block(None, [1, 2], (value,))


def test_request_hasher_check_refuses_a_full_block_left_in_the_tail() -> None:
    """A tail of hash_block_size tokens is a block `extend` should have hashed."""
    request = RequestHasher(BlockHasher(2))
    request.extend([1, 2, 3])
    request.check_invariants()
    request._tail.append(4)
    with pytest.raises(AssertionError, match="tail of 2 tokens is a full block"):
        request.check_invariants()
