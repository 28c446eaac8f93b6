"""The doorkeeper and the count-min sketch against plain reference versions written here.

Both are on a tier's hot path (one call per block offered or accessed), so their code is
unrolled for speed; these tests pin their answers to the documented hashing: a key's
first 8 bytes as a little-endian number, mixed with its group id, and probe `i` the top
bits of `x * multiplier_i mod 2**64`. Tables this small collide often, so a probe that
differs changes answers within a few operations.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.core.keys import Key, make_key
from kvtier.core.policies import DoorkeeperAdmission
from kvtier.core.policies.sketch import _MULTIPLIERS, CountMinSketch, Doorkeeper

MASK = 2**64 - 1


def number(key: Key) -> int:
    group_id = int.from_bytes(key[-4:], "big")
    return int.from_bytes(key[:8], "little") ^ ((group_id * _MULTIPLIERS[0]) & MASK)


def table_bits(counters: int) -> int:
    """Bits of a table index: at least 6, enough for `counters`."""
    return max(6, (counters - 1).bit_length())


def probes(key: Key, bits: int, depth: int) -> list[int]:
    return [((number(key) * m) & MASK) >> (64 - bits) for m in _MULTIPLIERS[:depth]]


class ReferenceDoorkeeper:
    """Two generations of sets of bit numbers."""

    def __init__(self, window: int) -> None:
        self.bits = table_bits(10 * window)
        self.window = window
        self.current: set[int] = set()
        self.previous: set[int] = set()
        self.inserted = 0

    def contains(self, key: Key) -> bool:
        wanted = set(probes(key, self.bits, 3))
        return wanted <= self.current or wanted <= self.previous

    def insert(self, key: Key) -> None:
        self.current.update(probes(key, self.bits, 3))
        self.inserted += 1
        if self.inserted == self.window:
            self.inserted = 0
            self.previous, self.current = self.current, set()


class ReferenceSketch:
    """Counters in a dict, conservative update, saturating at 15, halved every period."""

    def __init__(self, width: int, period: int, depth: int) -> None:
        self.bits = table_bits(width)
        self.depth = depth
        self.period = period
        self.counts: dict[tuple[int, int], int] = {}
        self.adds = 0

    def cells(self, key: Key) -> list[tuple[int, int]]:
        return list(enumerate(probes(key, self.bits, self.depth)))

    def estimate(self, key: Key) -> int:
        return min(self.counts.get(cell, 0) for cell in self.cells(key))

    def add(self, key: Key) -> int:
        low = self.estimate(key)
        if low < 15:
            for cell in self.cells(key):
                if self.counts.get(cell, 0) == low:
                    self.counts[cell] = low + 1
            low += 1
        self.adds += 1
        if self.adds == self.period:
            self.adds = 0
            self.counts = {cell: count // 2 for cell, count in self.counts.items()}
        return low


keys = st.builds(make_key, st.binary(min_size=8, max_size=8), st.sampled_from([0, 1, 7, 2**32 - 1]))


@settings(max_examples=scaled_examples(200), deadline=None)
@given(
    window=st.integers(1, 40),
    ops=st.lists(st.tuples(st.sampled_from(["contains", "insert", "both"]), keys), max_size=300),
)
def test_doorkeeper_answers_as_the_reference(window: int, ops: list[tuple[str, Key]]) -> None:
    """`contains`, `insert` and `seen_or_insert` agree with two sets of bit numbers."""
    doorkeeper, reference = Doorkeeper(window), ReferenceDoorkeeper(window)
    for op, key in ops:
        if op == "contains":
            assert doorkeeper.contains(key) == reference.contains(key)
        elif op == "insert":
            doorkeeper.insert(key)
            reference.insert(key)
        else:
            seen = reference.contains(key)
            if not seen:
                reference.insert(key)
            assert doorkeeper.seen_or_insert(key) == seen
        doorkeeper.check_invariants()


@settings(max_examples=scaled_examples(100), deadline=None)
@given(num_blocks=st.integers(2, 20), offers=st.lists(keys, max_size=300))
def test_door_admits_on_the_references_second_sighting(num_blocks: int, offers: list[Key]) -> None:
    """`door` admits exactly the offers the reference filter had seen, and counts the rest."""
    admission = DoorkeeperAdmission(num_blocks)
    reference = ReferenceDoorkeeper(max(1, num_blocks - 1) * 2)
    num_rejected = 0
    for key in offers:
        seen = reference.contains(key)
        if not seen:
            reference.insert(key)
            num_rejected += 1
        assert admission.admit(key) == seen
    assert admission.num_rejected == num_rejected


@settings(max_examples=scaled_examples(200), deadline=None)
@given(
    width=st.integers(1, 200),
    period=st.integers(1, 60),
    depth=st.integers(1, 4),
    ops=st.lists(st.tuples(st.booleans(), keys), max_size=300),
)
def test_count_min_sketch_counts_as_the_reference(
    width: int, period: int, depth: int, ops: list[tuple[bool, Key]]
) -> None:
    """`add` and `estimate` agree with counters kept in a dict, aging included."""
    sketch, reference = CountMinSketch(width, period, depth), ReferenceSketch(width, period, depth)
    for add, key in ops:
        if add:
            assert sketch.add(key) == reference.add(key)
        else:
            assert sketch.estimate(key) == reference.estimate(key)
        sketch.check_invariants()
