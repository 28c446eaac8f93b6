"""`ChatWorkload` (the demo's workload) rejects a negative seed.

Regression: `ChatWorkload(seed=-3)` was accepted and drew the token ids of seed 3
(`random.Random` seeds a negative number with its absolute value)."""

from __future__ import annotations

import pytest

from kvtier.engine.chat_workload import ChatWorkload, percentile


def test_a_negative_seed_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^seed must be >= 0, got -3$"):
        ChatWorkload(seed=-3)
    assert ChatWorkload(seed=0).seed == 0


def test_percentile_is_linear_between_sorted_values_at_every_q() -> None:
    """Regression: q below 0.005 gave the 99th percentile and q = 1 an IndexError."""
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(values, q) for q in (0, 0.001, 0.5, 0.9, 1)] == [1.0, 1.004, 3.0, 4.6, 5.0]
    assert percentile([], 0.5) == 0.0
    assert percentile([7.0], 1) == 7.0
    with pytest.raises(ValueError, match="q must be in"):
        percentile(values, 1.5)


def test_an_empty_first_prompt_and_a_non_int_count_are_refused() -> None:
    """Regression: all prompt parts 0 failed later in `run_chat` ("prompt 0: empty
    prompt"); `num_turns="3"` was a TypeError from a comparison."""
    with pytest.raises(ValueError, match="are all 0: the first prompt is empty"):
        ChatWorkload(num_system_tokens=0, num_document_tokens=0, num_user_tokens=0)
    with pytest.raises(TypeError, match=r"^num_turns must be an int, got '3'$"):
        ChatWorkload(num_turns="3")  # type: ignore[arg-type]
    assert ChatWorkload(num_system_tokens=0, num_document_tokens=0).num_user_tokens == 64


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_conversations", 0, "num_conversations must be > 0, got 0"),
        ("num_turns", 0, "num_turns must be > 0, got 0"),
        ("num_answer_tokens", 0, "num_answer_tokens must be > 0, got 0"),
        ("vocab_size", 0, "vocab_size must be > 0, got 0"),
        ("num_system_tokens", -1, "num_system_tokens must be >= 0, got -1"),
        ("num_document_tokens", -1, "num_document_tokens must be >= 0, got -1"),
        ("num_user_tokens", -1, "num_user_tokens must be >= 0, got -1"),
    ],
)
def test_each_count_out_of_range_is_refused_naming_it(field: str, value: int, message: str) -> None:
    """Found by a mutation run (s32): each of these was unpinned. Accepted, a count of
    0 served nothing or failed later in `run_chat`, and a negative prompt part drew no
    tokens, as if it were 0."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        ChatWorkload(**{field: value})


def test_a_bool_count_is_refused() -> None:
    """`True` is an int to isinstance; as a count it is a mistake (mutant, s32)."""
    with pytest.raises(TypeError, match=r"^num_turns must be an int, got True$"):
        ChatWorkload(num_turns=True)
