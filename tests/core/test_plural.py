"""`counted`: a count and its noun in messages, singular for one only."""

from __future__ import annotations

import pytest

from kvtier.core.plural import counted


@pytest.mark.parametrize(
    ("number", "expected"),
    [(0, "0 blocks"), (1, "1 block"), (2, "2 blocks"), (78, "78 blocks")],
)
def test_counted_is_singular_for_one_only(number: int, expected: str) -> None:
    assert counted(number, "block") == expected


def test_counted_keeps_a_noun_of_several_words() -> None:
    assert counted(1, "usable block") == "1 usable block"
    assert counted(3, "distinct block") == "3 distinct blocks"
