"""More random operation sequences on BlockPool against an independent model: the
operations the first machine leaves out (pin, evict_keys, release_evicted,
discard_secondary_key, discard_all_keys, token tags, on_evict, reset's removed list)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from example_counts import scaled_examples
from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool, PoolError
from kvtier.core.events import AllCleared, BlockRemoved, BlockStored
from kvtier.core.keys import Key, key_block_hash, key_group_id, make_key

KEYS = [
    make_key(hashlib.sha256(str(i).encode()).digest(), group_id)
    for i in range(4)
    for group_id in (0, 1)
]
TAGS = [None, b"t" * 16, b"u" * 16]


def removed(key: Key, medium: str | None) -> BlockRemoved:
    return BlockRemoved(key_block_hash(key), key_group_id(key), medium)


class Machine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 7), events=st.booleans())
    def make(self, num_blocks: int, events: bool) -> None:
        self.n = num_blocks
        self.pool = BlockPool(num_blocks, medium="CPU", record_events=events)
        self.events = events
        self.refs = [0] * num_blocks
        self.free = list(range(1, num_blocks))
        self.keys: dict[int, list[Key]] = {}
        self.tags: dict[int, bytes] = {}
        self.pending: list = []
        self.evicted: list[tuple[int, Key]] = []
        self.seen_evicted: list[tuple[int, Key]] = []
        self.pool.on_evict = lambda b, k: self.seen_evicted.append((b, k))

    def rec(self, event) -> None:
        if self.events:
            self.pending.append(event)

    def drop(self, b: int) -> None:
        for key in self.keys.pop(b, []):
            self.rec(removed(key, "CPU"))
        self.tags.pop(b, None)

    def model_insert(self, key: Key, b: int, tag) -> None:
        """The model's side of inserting `key` on block `b` (first key: primary, tagged)."""
        held = self.keys.setdefault(b, [])
        if key in held:
            return
        if not held:
            if tag is not None:
                self.tags[b] = tag
            if self.refs[b] == 0:
                self.free.remove(b)
                self.free.append(b)
        held.append(key)
        self.rec(BlockStored(key_block_hash(key), key_group_id(key), 16, medium="CPU"))

    @rule(data=st.data())
    def allocate(self, data) -> None:
        num = data.draw(st.integers(0, len(self.free)))
        expected, self.free = self.free[:num], self.free[num:]
        for b in expected:
            if b in self.keys:
                self.evicted.append((b, self.keys[b][0]))
            self.drop(b)
            self.refs[b] = 1
        assert self.pool.allocate(num) == expected

    @rule(data=st.data(), pin=st.booleans())
    def touch_or_pin(self, data, pin: bool) -> None:
        ids = data.draw(st.lists(st.integers(0, self.n - 1), max_size=3))
        for b in ids:
            if b == NULL_BLOCK_ID:
                continue
            if self.refs[b] == 0:
                self.free.remove(b)
            self.refs[b] += 1
        (self.pool.pin if pin else self.pool.touch)(ids)

    @rule(data=st.data())
    def free_some(self, data) -> None:
        held = [b for b in range(1, self.n) for _ in range(self.refs[b])]
        if not held:
            return
        ids = data.draw(st.permutations(held))
        ids = ids[: data.draw(st.integers(1, len(ids)))]
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.keys:
                    self.free.append(b)
                else:
                    self.free.insert(0, b)
        self.pool.free(ids)

    @rule(data=st.data(), key=st.sampled_from(KEYS), tag=st.sampled_from(TAGS))
    def insert_key(self, data, key: Key, tag) -> None:
        b = data.draw(st.integers(1, self.n - 1))
        self.model_insert(key, b, tag)
        self.pool.insert_key(key, b, 16, tag=tag)

    @rule(data=st.data())
    def insert_keys_with_tags(self, data) -> None:
        entries = data.draw(
            st.lists(
                st.tuples(st.sampled_from(KEYS), st.integers(1, self.n - 1), st.sampled_from(TAGS)),
                max_size=3,
            )
        )
        for key, b, tag in entries:
            self.model_insert(key, b, tag)
        tags = {i: t for i, (_, _, t) in enumerate(entries) if t is not None}
        self.pool.insert_keys(
            [k for k, _, _ in entries], [b for _, b, _ in entries], [16] * len(entries), tags
        )

    @rule(data=st.data())
    def discard_secondary_key(self, data) -> None:
        b = data.draw(st.integers(0, self.n - 1))
        key = data.draw(st.sampled_from(KEYS))
        held = self.keys.get(b, [])
        if key in held[1:]:
            held.remove(key)
            self.rec(removed(key, "CPU"))
        self.pool.discard_secondary_key(b, key)

    @rule(data=st.data())
    def evict_keys(self, data) -> None:
        b = data.draw(st.integers(0, self.n - 1))
        if b in self.keys and self.keys[b] and self.refs[b]:
            with pytest.raises(PoolError):
                self.pool.evict_keys(b)
            return
        if self.keys.get(b):
            self.drop(b)
            self.free.remove(b)
            self.free.insert(0, b)
        self.keys.pop(b, None)
        self.pool.evict_keys(b)

    @rule(data=st.data())
    def release_evicted(self, data) -> None:
        b = data.draw(st.integers(0, self.n - 1))
        if not self.keys.get(b) or self.refs[b] != 1:
            with pytest.raises(PoolError):
                self.pool.release_evicted(b)
            return
        self.refs[b] = 0
        self.drop(b)
        self.free.insert(0, b)
        self.pool.release_evicted(b)

    @rule()
    def discard_all_keys(self) -> None:
        for b in sorted(b for b, k in self.keys.items() if k):
            self.drop(b)
            if self.refs[b] == 0:
                self.free.remove(b)
                self.free.insert(0, b)
        self.keys.clear()
        self.pool.discard_all_keys()

    @rule()
    def reset(self) -> None:
        if any(self.refs):
            assert self.pool.reset() is False
            return
        expected_removed = Counter(removed(k, "CPU") for held in self.keys.values() for k in held)
        self.keys.clear()
        self.tags.clear()
        self.free = list(range(1, self.n))
        assert self.pool.reset() is True
        if self.events:
            event = self.pool._events[-1]
            assert isinstance(event, AllCleared)
            assert Counter(event.removed) == expected_removed
            self.pending.append(AllCleared("CPU"))

    @rule()
    def take_events(self) -> None:
        assert self.pool.take_events() == self.pending
        self.pending = []

    @invariant()
    def matches(self) -> None:
        pool = self.pool
        pool.check_invariants()
        assert list(pool.iter_free_after(None)) == self.free
        assert self.seen_evicted == self.evicted
        for b in range(self.n):
            held = self.keys.get(b, [])
            assert pool.ref_count(b) == self.refs[b]
            assert pool.key(b) == (held[0] if held else None)
            assert list(pool.secondary_keys(b)) == held[1:]
            assert pool.tag(b) == (self.tags.get(b) if held else None)
            for key in held[1:]:
                assert pool.tag(b, key) is None
        for key in KEYS:
            holders = {b for b, h in self.keys.items() if key in h}
            assert set(pool.cached_blocks(key)) == holders
            assert len(pool.cached_blocks(key)) == len(holders)


Machine.TestCase.settings = settings(
    max_examples=scaled_examples(400), stateful_step_count=40, deadline=None
)
test_more = Machine.TestCase
