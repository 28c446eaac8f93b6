"""`make test-deep` scales every property test's examples through KVTIER_EXAMPLES_SCALE."""

from __future__ import annotations

import pytest

from example_counts import SCALE_VARIABLE, scaled_examples


@pytest.mark.parametrize(("value", "count"), [(None, 40), ("", 40), ("1", 40), (" 10 ", 400)])
def test_the_scale_multiplies_a_test_s_own_count(
    monkeypatch: pytest.MonkeyPatch, value: str | None, count: int
) -> None:
    if value is None:
        monkeypatch.delenv(SCALE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(SCALE_VARIABLE, value)
    assert scaled_examples(40) == count


@pytest.mark.parametrize("value", ["0", "-2", "ten", "1.5"])
def test_a_scale_that_is_no_positive_int_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(SCALE_VARIABLE, value)
    with pytest.raises(
        ValueError, match=f"KVTIER_EXAMPLES_SCALE must be a positive int, got '{value}'"
    ):
        scaled_examples(40)
