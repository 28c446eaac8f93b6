"""`kvtier replay`'s option types at their edges, found by the first mutation run on
option_types.py: a negative or dot-ended token count, a fraction of a token below 1,
`-.5M` after an option, `--`, the least rate and the largest bytes per token."""

from __future__ import annotations

import argparse

import pytest

from kvtier.replay.option_types import (
    MAX_BYTES_PER_TOKEN,
    MIN_RATE,
    attach_dashed_values,
    bytes_per_token,
    parse_tokens,
    rate,
    trace_path,
)


@pytest.mark.parametrize("text", ["-1M", "-5", "1.M", "1.", ".5M"])
def test_a_negative_or_half_written_token_count_is_refused(text: str) -> None:
    """Token counts are digits, an optional fraction with digits after the point, and
    an optional k, M or G: no sign, no bare point."""
    with pytest.raises(argparse.ArgumentTypeError, match=rf"invalid token count {text!r}: use"):
        parse_tokens(text)


def test_a_fraction_of_one_token_is_shown_with_its_leading_zero() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"\(it is 0\.1\)$"):
        parse_tokens("0.0001k")


def test_a_dashed_fraction_after_an_option_is_joined_to_it() -> None:
    """`--capacity -.5M` reaches the option's type (argparse would read `-.5M` as an
    option and report only "expected one argument")."""
    assert attach_dashed_values(["--capacity", "-.5M"]) == ["--capacity=-.5M"]
    assert attach_dashed_values(["--capacity", "-1M"]) == ["--capacity=-1M"]


def test_nothing_after_a_double_dash_or_after_a_short_option_is_joined() -> None:
    """Only long options take a dashed value joined; after `--` every word is a
    positional argument and stays as typed."""
    assert attach_dashed_values(["-v", "-1"]) == ["-v", "-1"]
    assert attach_dashed_values(["--", "--capacity", "-1M"]) == ["--", "--capacity", "-1M"]


def test_the_least_rate_is_taken() -> None:
    assert rate(f"{MIN_RATE:g}") == MIN_RATE


def test_the_largest_bytes_per_token_is_taken() -> None:
    assert bytes_per_token(str(MAX_BYTES_PER_TOKEN)) == MAX_BYTES_PER_TOKEN
    with pytest.raises(argparse.ArgumentTypeError, match="must be <= 1073741824"):
        bytes_per_token(str(MAX_BYTES_PER_TOKEN + 1))


def test_a_dash_names_stdin() -> None:
    assert trace_path("-") == "/dev/stdin"
    assert trace_path("t.jsonl") == "t.jsonl"
