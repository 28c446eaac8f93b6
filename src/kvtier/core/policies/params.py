"""Checks of the policies' numeric parameters (direct construction; names go through
`PolicySpec`)."""

from __future__ import annotations

import math


def check_int_at_least(value: object, name: str, minimum: int) -> None:
    """Raise ValueError naming `value` unless it is an int (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_finite_at_least(value: object, name: str, minimum: float) -> None:
    """Raise ValueError naming `value` unless it is a finite real number >= `minimum`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < minimum
    ):
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")
