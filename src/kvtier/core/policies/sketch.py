"""Compact, aging summaries of which keys were seen: a count-min sketch and a doorkeeper.

Both hash a key by its first 8 bytes mixed with its group id (block hashes are uniformly
distributed; keys made from small integers are spread by the multiplicative hash), so the
same key always lands in the same counters across processes — replays are reproducible —
and a prefix's keys of two KV groups are counted apart. Both age: without it a
key popular an hour ago would look popular forever.
"""

from __future__ import annotations

from kvtier.core.keys import Key, key_group_id
from kvtier.core.policies.params import check_int_at_least

_MASK64 = (1 << 64) - 1
# Odd 64-bit multipliers (golden ratio and other well-mixed constants), one per row/probe.
_MULTIPLIERS = (
    0x9E3779B97F4A7C15,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0xD6E8FEB86659FD93,
)
_M0, _M1, _M2 = _MULTIPLIERS[:3]  # the doorkeeper's 3 probes
_HALVE = bytes(i >> 1 for i in range(256))
_MAX_COUNT = 15


def _log2_at_least(value: int) -> int:
    return max(6, (max(1, value) - 1).bit_length())


def _key_int(key: Key) -> int:
    """Return a 64-bit number of `key`: its hash's first 8 bytes, mixed with its group id
    (one prefix's keys of different groups are counted apart; group 0 is unchanged)."""
    x = int.from_bytes(key[:8], "little")
    group_id = key_group_id(key)
    return x ^ ((group_id * _MULTIPLIERS[0]) & _MASK64) if group_id else x


class CountMinSketch:
    """Approximate access counts (never under-estimated) with conservative update.

    `width` rounds up to a power of two; `depth` rows of one byte per counter, counts
    saturate at 15. Every `aging_period` additions all counters are halved, so a count
    measures recent popularity (TinyLFU's reset). Memory: `depth x width` bytes.
    """

    __slots__ = ("_adds", "_depth", "_period", "_rows", "_shift", "_table", "_width")

    def __init__(self, width: int, aging_period: int, depth: int = 4) -> None:
        if not 1 <= depth <= len(_MULTIPLIERS):
            raise ValueError(f"depth must be in [1, {len(_MULTIPLIERS)}], got {depth}")
        check_int_at_least(width, "width", 1)
        check_int_at_least(aging_period, "aging_period", 1)
        bits = _log2_at_least(width)
        self._width = 1 << bits
        self._shift = 64 - bits
        self._depth = depth
        # Each row's first counter and multiplier.
        self._rows = tuple((row * self._width, m) for row, m in enumerate(_MULTIPLIERS[:depth]))
        self._table = bytearray(depth * self._width)
        self._period = aging_period
        self._adds = 0

    @property
    def width(self) -> int:
        """Return the number of counters per row."""
        return self._width

    def _slots(self, key: Key) -> list[int]:
        x = _key_int(key)
        s = self._shift
        return [start + (((x * m) & _MASK64) >> s) for start, m in self._rows]

    def add(self, key: Key) -> int:
        """Count one access of `key`; return its new estimated count."""
        table = self._table
        slots = self._slots(key)
        low = min(map(table.__getitem__, slots))
        if low < _MAX_COUNT:
            for i in slots:
                if table[i] == low:
                    table[i] = low + 1
            low += 1
        self._adds += 1
        if self._adds >= self._period:
            self._adds = 0
            self._table = bytearray(self._table.translate(_HALVE))
        return low

    def estimate(self, key: Key) -> int:
        """Return the estimated recent access count of `key`."""
        return min(map(self._table.__getitem__, self._slots(key)))

    def check_invariants(self) -> None:
        """Raise AssertionError on a corrupt table."""
        assert len(self._table) == self._depth * self._width, "sketch table size"
        assert max(self._table, default=0) <= _MAX_COUNT, "sketch counter overflow"
        assert 0 <= self._adds < self._period, "sketch aging counter out of range"


class Doorkeeper:
    """ "Was this key seen recently?" as two generations of a Bloom filter.

    Keys go into the current generation; after `window` insertions the current one
    becomes the previous one and a fresh one starts, so a key is remembered for between
    `window` and `2 x window` insertions. ~10 bits per remembered key, 3 probes
    (about 2 % false positives). Memory: 2 x 10 x `window` bits, rounded up.
    """

    __slots__ = ("_current", "_inserted", "_previous", "_shift", "_window")

    def __init__(self, window: int) -> None:
        check_int_at_least(window, "window", 1)
        bits = _log2_at_least(10 * window)
        self._shift = 64 - bits
        self._current = bytearray(1 << (bits - 3))
        self._previous = bytearray(1 << (bits - 3))
        self._window = window
        self._inserted = 0

    def _probes(self, key: Key) -> tuple[int, int, int, int, int, int]:
        """Return the key's 3 probes as (byte index, bit mask) pairs, flattened.

        Unrolled: on a tier's hot path this runs once per block offered, and the loop
        and list forms cost about 3 µs per admission, more than storing the block.
        """
        x = _key_int(key)
        s = self._shift
        b0 = ((x * _M0) & _MASK64) >> s
        b1 = ((x * _M1) & _MASK64) >> s
        b2 = ((x * _M2) & _MASK64) >> s
        return b0 >> 3, 1 << (b0 & 7), b1 >> 3, 1 << (b1 & 7), b2 >> 3, 1 << (b2 & 7)

    def contains(self, key: Key) -> bool:
        """Return True when `key` was (probably) inserted within the last two generations."""
        return self._seen(*self._probes(key))

    def insert(self, key: Key) -> None:
        """Remember `key`, rotating generations every `window` insertions."""
        self._set(*self._probes(key))

    def seen_or_insert(self, key: Key) -> bool:
        """Return `contains(key)`; when False, also `insert(key)` (one hashing for both)."""
        probes = self._probes(key)
        if self._seen(*probes):
            return True
        self._set(*probes)
        return False

    def _seen(self, i0: int, m0: int, i1: int, m1: int, i2: int, m2: int) -> bool:
        cur, prev = self._current, self._previous
        return bool(
            (cur[i0] & m0 and cur[i1] & m1 and cur[i2] & m2)
            or (prev[i0] & m0 and prev[i1] & m1 and prev[i2] & m2)
        )

    def _set(self, i0: int, m0: int, i1: int, m1: int, i2: int, m2: int) -> None:
        table = self._current
        table[i0] |= m0
        table[i1] |= m1
        table[i2] |= m2
        self._inserted += 1
        if self._inserted >= self._window:
            self._inserted = 0
            self._previous = table
            self._current = bytearray(len(table))

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent generations."""
        assert len(self._current) == len(self._previous), "doorkeeper generations differ"
        assert 0 <= self._inserted < self._window, "doorkeeper insert counter out of range"
