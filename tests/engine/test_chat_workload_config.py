"""`ChatWorkload` (the demo's workload) rejects a negative seed.

Regression: `ChatWorkload(seed=-3)` was accepted and drew the token ids of seed 3
(`random.Random` seeds a negative number with its absolute value)."""

from __future__ import annotations

import pytest

from kvtier.engine.chat_workload import ChatWorkload


def test_a_negative_seed_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^seed must be >= 0, got -3$"):
        ChatWorkload(seed=-3)
    assert ChatWorkload(seed=0).seed == 0
