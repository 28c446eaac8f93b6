"""Policies built directly refuse bad numeric parameters, naming them (a NaN `z` made
the duel LRU forever, a NaN window became 1, a float window raised AttributeError)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest

from kvtier.core.policies.admission import DoorkeeperAdmission
from kvtier.core.policies.dueling import DuelingPolicy
from kvtier.core.policies.lfuda import LFUDAPolicy
from kvtier.core.policies.sketch import CountMinSketch, Doorkeeper

BAD: list[tuple[str, Callable[[object], object], object]] = [
    ("z", lambda v: DuelingPolicy(16, z=v), math.nan),  # type: ignore[arg-type]
    ("z", lambda v: DuelingPolicy(16, z=v), math.inf),  # type: ignore[arg-type]
    ("z", lambda v: DuelingPolicy(16, z=v), -0.5),  # type: ignore[arg-type]
    ("z", lambda v: DuelingPolicy(16, z=v), "1"),  # type: ignore[arg-type]
    ("max_shadow_blocks", lambda v: DuelingPolicy(16, max_shadow_blocks=v), True),  # type: ignore[arg-type]
    ("max_shadow_blocks", lambda v: DuelingPolicy(16, max_shadow_blocks=v), 2.5),  # type: ignore[arg-type]
    ("window_per_block", lambda v: DoorkeeperAdmission(16, v), math.nan),  # type: ignore[arg-type]
    ("window_per_block", lambda v: DoorkeeperAdmission(16, v), 1.5),  # type: ignore[arg-type]
    ("window", lambda v: Doorkeeper(v), 2.5),  # type: ignore[arg-type]
    ("window", lambda v: Doorkeeper(v), 0),  # type: ignore[arg-type]
    ("width", lambda v: CountMinSketch(v, 8), 0),  # type: ignore[arg-type]
    ("width", lambda v: CountMinSketch(v, 8), 4.0),  # type: ignore[arg-type]
    ("aging_period", lambda v: CountMinSketch(16, v), 1.5),  # type: ignore[arg-type]
    ("aging_period", lambda v: CountMinSketch(16, v), 0),  # type: ignore[arg-type]
    # F is a sketch count, which saturates at 15.
    ("max_frequency", lambda v: LFUDAPolicy(16, max_frequency=v), 0),  # type: ignore[arg-type]
    ("max_frequency", lambda v: LFUDAPolicy(16, max_frequency=v), 16),  # type: ignore[arg-type]
    ("max_frequency", lambda v: LFUDAPolicy(16, max_frequency=v), True),  # type: ignore[arg-type]
    ("max_frequency", lambda v: LFUDAPolicy(16, max_frequency=v), 2.0),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "build", "value"), BAD)
def test_a_bad_parameter_is_refused_naming_it(
    name: str, build: Callable[[object], object], value: object
) -> None:
    with pytest.raises(ValueError, match=f"{name} must be .* got {re.escape(repr(value))}"):
        build(value)


def test_good_parameters_are_accepted() -> None:
    DuelingPolicy(16, z=0, max_shadow_blocks=1)
    DuelingPolicy(16, z=2.5)
    DoorkeeperAdmission(16, 1)
    LFUDAPolicy(16, max_frequency=1)
    LFUDAPolicy(16, max_frequency=15)
    CountMinSketch(1, 1)
    Doorkeeper(1)
