"""The count-min sketch's and the doorkeeper's rules on hand-picked keys whose counters
or bits collide (a mutation run found the random reference comparisons of
test_sketch_reference.py rarely hit these cases): conservative update, all three probes
in one generation, the table size, and the checks of their counters."""

from __future__ import annotations

import pytest
from policy_helpers import key
from test_sketch_reference import probes

from kvtier.core.policies.sketch import CountMinSketch, Doorkeeper


def test_count_min_sketch_raises_only_the_counters_at_the_minimum() -> None:
    """Width 64, depth 2. Keys 2053 and 36 share row 1's counter 24, keys 36 and 2209 row
    0's counter 15. Adding 2053, 36, 2209 sets every counter they touch to 1 only under
    conservative update (36 and 2209 each raise just their counter at 0); so the second
    add of 36 counts 2. Incrementing every counter would have put 2 in both of 36's
    counters and counted 3."""
    assert probes(key(2053), 6, 2) == [52, 24]
    assert probes(key(36), 6, 2) == [15, 24]
    assert probes(key(2209), 6, 2) == [15, 1]
    sketch = CountMinSketch(64, 1000, depth=2)
    assert [sketch.add(key(i)) for i in (2053, 36, 2209)] == [1, 1, 1]
    assert sketch.add(key(36)) == 2
    assert sketch.estimate(key(2053)) == 1


@pytest.mark.parametrize(("width", "counters"), [(1, 64), (64, 64), (65, 128), (128, 128)])
def test_count_min_sketch_width_rounds_up_to_a_power_of_two_of_at_least_64(
    width: int, counters: int
) -> None:
    """A power of two is kept as is, not doubled (the memory the docs promise)."""
    assert CountMinSketch(width, 8).width == counters


@pytest.mark.parametrize("window", [1, 2])
def test_doorkeeper_needs_all_three_probes_in_one_generation(window: int) -> None:
    """Key 1 sets bits {5, 39, 48} of a 64-bit generation; key 807's probes are 48, 48
    and 26: two of its three probes are set, so it was not seen. With window 1 key 1 is
    in the previous generation, with window 2 in the current one."""
    assert set(probes(key(1), 6, 3)) == {5, 39, 48}
    assert probes(key(807), 6, 3) == [48, 48, 26]
    doorkeeper = Doorkeeper(window)
    doorkeeper.insert(key(1))
    assert doorkeeper.contains(key(1))
    assert not doorkeeper.contains(key(807))


def test_count_min_sketch_check_refuses_a_counter_over_15_and_a_late_aging() -> None:
    sketch = CountMinSketch(64, 8)
    sketch.add(key(1))
    sketch.check_invariants()
    sketch._table[0] = 16
    with pytest.raises(AssertionError, match="sketch counter overflow"):
        sketch.check_invariants()
    sketch._table[0] = 0
    sketch._adds = 8  # the halving is due at the 8th add
    with pytest.raises(AssertionError, match="aging counter out of range"):
        sketch.check_invariants()


def test_doorkeeper_check_refuses_an_insert_counter_at_the_window() -> None:
    doorkeeper = Doorkeeper(3)
    doorkeeper.insert(key(1))
    doorkeeper.check_invariants()
    doorkeeper._inserted = 3  # the generation turns over at the 3rd insert
    with pytest.raises(AssertionError, match="insert counter out of range"):
        doorkeeper.check_invariants()
