"""Numeric command-line options that take ASCII only (digits 0-9).

int() and float() also read other scripts' digits (Arabic-Indic or full-width 16) and
Unicode spaces, so a value the user never saw as a number (a paste from another
keyboard layout, a stray no-break space) would run as one. They also read Python's digit
separator (`1_000`), which these refuse, as the token counts (`--capacity 300k`) do and
as the message ("use digits 0-9") says. Use these as argparse `type=`: argparse then
names the option in front of the message (exit status 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

Number = TypeVar("Number", int, float)


def ascii_int(text: str) -> int:
    """Parse an integer written in ASCII: digits 0-9 (no '_'), an optional sign."""
    return _parse_ascii(text, int, "integer", "digits 0-9")


def ascii_float(text: str) -> float:
    """Parse a number written in ASCII: digits 0-9, '.', an optional sign and exponent."""
    return _parse_ascii(text, float, "number", "digits 0-9, e.g. 2.5 or 1e9")


def _parse_ascii(text: str, convert: Callable[[str], Number], what: str, hint: str) -> Number:
    """Return `convert(text)`; raise ArgumentTypeError naming `text` unless it is ASCII
    without '_'."""
    if text.isascii() and "_" not in text:
        try:
            return convert(text)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: use {hint}")
