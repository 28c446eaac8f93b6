"""How many examples a property test draws: its own count, times `KVTIER_EXAMPLES_SCALE`.

Hypothesis draws new examples on every run (the tests are not derandomized), so a rare
case can surface in any CI run. `make test-deep` runs the property tests with the scale
raised (default 10) to find such cases on purpose; a failing example found there belongs
in the test as an explicit `@example`, so that every later run replays it.

The derandomized engine tests keep literal counts: hypothesis seeds their examples from
their source, decorators included, and their totals' coverage checks were set on those
examples (a CI run on the examples a changed decorator drew saw no bad-slot load).
"""

from __future__ import annotations

import os

SCALE_VARIABLE = "KVTIER_EXAMPLES_SCALE"


def example_scale() -> int:
    """Return the positive int in `KVTIER_EXAMPLES_SCALE` (1 where it is unset or empty)."""
    text = os.environ.get(SCALE_VARIABLE, "").strip()
    if not text:
        return 1
    try:
        scale = int(text)
    except ValueError:
        scale = 0
    if scale < 1:
        raise ValueError(f"{SCALE_VARIABLE} must be a positive int, got {text!r}")
    return scale


def scaled_examples(count: int) -> int:
    """Return `count` times the scale: the `max_examples` a property test uses."""
    return count * example_scale()
