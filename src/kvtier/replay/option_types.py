"""Argument types of `kvtier replay`: token counts (`300k`, `1.5M`), policy names, and
the TTFT model's numbers. Each raises `argparse.ArgumentTypeError`, which argparse
reports naming the option."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from fractions import Fraction

from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES, PolicySpec
from kvtier.replay.ascii_number import ascii_float, ascii_int
from kvtier.replay.belady import OFFLINE_POLICIES
from kvtier.replay.config import MAX_TOKENS
from kvtier.replay.trace import MAX_BLOCK_SIZE

_SUFFIXES = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
# ASCII only: `\d` alone also matches other scripts' digits (Arabic-Indic, full-width) and
# IGNORECASE the Kelvin sign as k; Fraction and int() would read those digits as numbers.
_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)\s*$", re.IGNORECASE | re.ASCII)
# A size in bytes (10MiB, 10MB, 512B): a capacity counts tokens, so it is refused with that.
_BYTES = re.compile(r"^\s*\d+(?:\.\d+)?\s*(?:[kmgt]i?)?b\s*$", re.IGNORECASE | re.ASCII)
# The least rate the TTFT model takes (tokens/s, GB/s): slower ones make estimates of
# centuries, printed with hundreds of digits, or infinite (JSON has no infinity).
MIN_RATE = 1e-6
MAX_BYTES_PER_TOKEN = 1 << 30  # 1 GiB: a 405B model's KV in fp32 is about 1 MiB per token
# A value starting with a dash and a digit. argparse reads "-5" and "-0.5" as negative
# numbers but "-1M" and "-1e3" as options, and then reports only "expected one argument".
_DASHED_NUMBER = re.compile(r"^-\.?\d")


def trace_path(text: str) -> str:
    """Return the trace's path: `-` names stdin (`/dev/stdin`); an empty one is refused."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return "/dev/stdin" if text == "-" else text


def attach_dashed_values(argv: Sequence[str]) -> list[str]:
    """Return `argv` with each long option followed by a dashed number (`--capacity -1M`)
    joined into one argument (`--capacity=-1M`), so the option's type names what is
    wrong with the value. Nothing after `--` changes."""
    joined: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            joined.extend(argv[i:])
            break
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith("--") and "=" not in arg and _DASHED_NUMBER.match(value):
            joined.append(f"{arg}={value}")
            i += 2
        else:
            joined.append(arg)
            i += 1
    return joined


def parse_tokens(text: str) -> int:
    """Parse a whole token count like `300k`, `1M`, `1.5M` or `2000000`, at most
    MAX_TOKENS."""
    match = _CAPACITY.match(text)
    if match is None and _BYTES.match(text):
        raise argparse.ArgumentTypeError(
            f"invalid token count {text!r}: a capacity counts tokens, not bytes (KV bytes "
            "per token: --bytes-per-token); e.g. 300k, 1M, 1.5M or 2000000"
        )
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid token count {text!r}: use digits 0-9 and an optional k, M or G, e.g. "
            "300k, 1M, 1.5M or 2000000"
        )
    number = match.group(1)
    value = Fraction(number) * _SUFFIXES[match.group(2).lower()]
    if value.denominator != 1:
        places = len(number.partition(".")[2])  # exact: a float would round 1.0...01G
        digits = str(int(value * 10**places)).rjust(places + 1, "0")
        exact = f"{digits[:-places]}.{digits[-places:]}".rstrip("0")
        raise argparse.ArgumentTypeError(
            f"invalid token count {text!r}: not a whole number of tokens (it is {exact})"
        )
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(
            f"invalid token count {text!r}: more than {MAX_TOKENS:,} tokens (1000000000G), "
            "an exabyte of KV even at one byte per token"
        )
    return int(value)


def policy_name(text: str) -> str:
    """Parse a policy name: `EVICTION[+ADMISSION]`, or an offline one (`belady`)."""
    name = text.strip().lower()
    if name in OFFLINE_POLICIES:
        return name
    eviction, _, admission = (part.strip() for part in name.partition("+"))
    if eviction in OFFLINE_POLICIES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {eviction!r} is an offline policy with its own admission rule (store "
            f"only what is used again), so it takes no admission filter: no '+' after it; "
            f"use {eviction!r}"
        )
    if eviction not in EVICTION_POLICIES:
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}: use EVICTION[+ADMISSION] with eviction one of "
            f"{', '.join(EVICTION_POLICIES)} and admission one of "
            f"{', '.join(a for a in ADMISSION_POLICIES if a != 'all')}; or an offline "
            f"policy: {', '.join(OFFLINE_POLICIES)}"
        )
    if admission and admission not in ADMISSION_POLICIES:  # named as typed, not lowercased
        typed = text.strip().partition("+")[2].strip()
        raise argparse.ArgumentTypeError(
            f"unknown admission policy {typed!r} in {text!r}; choose one of "
            f"{', '.join(a for a in ADMISSION_POLICIES if a != 'all')}"
        )
    try:
        return PolicySpec.parse(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """Parse a whole number > 0 in ASCII digits (argparse names the option in the error)."""
    value = ascii_int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def rate(text: str) -> float:
    """Parse a finite rate >= MIN_RATE in ASCII digits (argparse names the option)."""
    value = ascii_float(text)
    if not MIN_RATE <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_RATE:g} and finite, got {text!r}")
    return value


def block_size(text: str) -> int:
    """Parse the tokens per trace block, 1 ... MAX_BLOCK_SIZE."""
    value = positive_int(text)
    if value > MAX_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_BLOCK_SIZE}, got {value}")
    return value


def bytes_per_token(text: str) -> int:
    """Parse the KV bytes per token, 1 ... MAX_BYTES_PER_TOKEN."""
    value = positive_int(text)
    if value > MAX_BYTES_PER_TOKEN:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_BYTES_PER_TOKEN} (1 GiB), got {value}")
    return value
