"""Every eviction policy under every key operation, with events and tags: random
operations on a `BlockPool`, checked against a model after every step.

`test_policies_stateful` and `test_policies_stateful_model` drive the policies without
events, secondary-key removal, `discard_all_keys` or tags; `test_block_pool_stateful_more`
drives those under LRU only. Here every policy gets all of them, with events on or off
and payloads kept or not, and after every step:
- the pool's `check_invariants()` (which runs the policy's) holds;
- each block's references, keys (primary first), token tag and kept payload match the
  model, and `cached_blocks` of every key names exactly the blocks holding it;
- for every free cached block the policy's noted key is the pool's primary key (a policy
  that kept a stale key would send a re-stored block to the wrong list);
- the events published so far, replayed, name exactly the keys the pool holds, once per
  holding block; `on_evict` saw exactly the cached blocks `allocate` evicted.
"""

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
from kvtier.core.policies import EVICTION_POLICIES, DuelingPolicy, EvictionPolicy

# Two groups: one prefix's keys of groups 0 and 1 share their hash bytes.
KEYS: list[Key] = [make_key(hashlib.sha256(bytes([i // 2])).digest(), i % 2) for i in range(10)]
TAGS = [None, b"tag-a", b"tag-b"]


def noted_key(policy: EvictionPolicy, block_id: int) -> Key | str | None:
    """Return the key the policy noted for `block_id`; "n/a" for LRU, which keeps none."""
    if isinstance(policy, DuelingPolicy):
        return policy._lfu.noted_key(block_id)
    keys = getattr(policy, "_keys", None)
    return "n/a" if keys is None else keys[block_id]


class PolicyEventsMachine(RuleBasedStateMachine):
    """A pool under one policy; the model: references, held keys, tags, payloads."""

    pool: BlockPool
    policy: EvictionPolicy
    refs: list[int]
    held: list[list[Key]]  # per block: primary first, then secondary keys in order
    tags: list[bytes | None]
    published: Counter[Key]  # the keys the events replayed so far say are held
    evicted: list[tuple[int, Key]]  # what on_evict was told
    expected_evicted: list[tuple[int, Key]]

    @initialize(
        name=st.sampled_from(sorted(EVICTION_POLICIES)),
        num_blocks=st.integers(2, 8),
        events=st.sampled_from(["off", "on", "payloads"]),
        lfu_order=st.booleans(),
    )
    def make(self, name: str, num_blocks: int, events: str, lfu_order: bool) -> None:
        self.policy = EVICTION_POLICIES[name](num_blocks)
        if isinstance(self.policy, DuelingPolicy):
            self.policy.lfu_order = lfu_order
        self.events = events != "off"
        self.payloads = events == "payloads"
        self.pool = BlockPool(
            num_blocks, free_queue=self.policy, medium="CPU", record_events=self.events
        )
        if self.payloads:
            self.pool.keep_payloads()
        self.evicted, self.expected_evicted = [], []
        self.pool.on_evict = lambda block_id, key: self.evicted.append((block_id, key))
        self.refs = [0] * num_blocks
        self.held = [[] for _ in range(num_blocks)]
        self.tags = [None] * num_blocks
        self.stored: dict[tuple[int, Key], BlockStored] = {}
        self.published = Counter()

    # ----------------------------------------------------------------- model

    def block_id(self, data: st.DataObject, label: str = "block_id") -> int:
        return data.draw(st.integers(1, self.pool.num_blocks - 1), label=label)

    def model_insert(self, key: Key, block_id: int, tag: bytes | None) -> None:
        if key in self.held[block_id]:
            return
        if not self.held[block_id]:
            self.tags[block_id] = tag
        self.held[block_id].append(key)

    def model_drop(self, block_id: int) -> None:
        for key in self.held[block_id]:
            self.stored.pop((block_id, key), None)
        self.held[block_id] = []
        self.tags[block_id] = None

    # ----------------------------------------------------------------- rules

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        """Take the next victims: exactly the blocks `iter_free_after` lists first."""
        listed = list(self.pool.iter_free_after(None))
        num = data.draw(st.integers(0, len(listed)), label="num")
        taken = self.pool.allocate(num)
        assert taken == listed[:num]
        for block_id in taken:
            assert self.refs[block_id] == 0, f"allocate handed out referenced block {block_id}"
            if self.held[block_id]:
                self.expected_evicted.append((block_id, self.held[block_id][0]))
            self.model_drop(block_id)
            self.refs[block_id] = 1

    @rule(data=st.data(), pin=st.booleans())
    def touch_or_pin(self, data: st.DataObject, pin: bool) -> None:
        ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=3))
        (self.pool.pin if pin else self.pool.touch)(ids)
        for block_id in ids:
            if block_id != NULL_BLOCK_ID:
                self.refs[block_id] += 1

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = [b for b in range(1, self.pool.num_blocks) if self.refs[b]]
        if held:
            ids = data.draw(st.lists(st.sampled_from(held), max_size=3, unique=True))
            self.pool.free(ids)
            for block_id in ids:
                self.refs[block_id] -= 1

    @rule(data=st.data(), key=st.sampled_from(KEYS), tag=st.sampled_from(TAGS))
    def insert_key(self, data: st.DataObject, key: Key, tag: bytes | None) -> None:
        """Any block, free ones included, with a payload-carrying event."""
        block_id = self.block_id(data)
        event = BlockStored(key_block_hash(key), key_group_id(key), 16, token_ids=(block_id,))
        if self.events and key not in self.held[block_id]:
            self.stored[block_id, key] = event
        self.pool.insert_key(key, block_id, 16, stored=event, tag=tag)
        self.model_insert(key, block_id, tag)

    @rule(data=st.data())
    def insert_keys(self, data: st.DataObject) -> None:
        num = data.draw(st.integers(0, 3), label="num")
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=num, max_size=num))
        ids = [self.block_id(data, f"block_id {i}") for i in range(num)]
        tags = {i: b"tag-a" for i in range(num) if data.draw(st.booleans(), label=f"tag {i}")}
        self.pool.insert_keys(keys, ids, [16] * num, tags)
        for i, (key, block_id) in enumerate(zip(keys, ids, strict=True)):
            self.model_insert(key, block_id, tags.get(i))

    @rule(data=st.data())
    def discard_keys(self, data: st.DataObject) -> None:
        block_id = data.draw(st.integers(0, self.pool.num_blocks - 1), label="block_id")
        self.pool.discard_keys(block_id)
        self.model_drop(block_id)

    @rule(data=st.data())
    def discard_secondary_key(self, data: st.DataObject) -> None:
        block_id = self.block_id(data)
        # Mostly a key the block holds (a secondary one, or its primary: a no-op).
        held = self.held[block_id]
        key = data.draw(st.sampled_from(held) if held else st.sampled_from(KEYS), label="key")
        self.pool.discard_secondary_key(block_id, key)
        if key in self.held[block_id][1:]:
            self.held[block_id].remove(key)
            self.stored.pop((block_id, key), None)

    @rule(data=st.data())
    def evict_keys(self, data: st.DataObject) -> None:
        block_id = self.block_id(data)
        if self.held[block_id] and self.refs[block_id]:
            with pytest.raises(PoolError, match=f"block {block_id} is in use"):
                self.pool.evict_keys(block_id)
            return
        self.pool.evict_keys(block_id)
        self.model_drop(block_id)

    @rule(data=st.data())
    def release_evicted(self, data: st.DataObject) -> None:
        """A write-back demotion: pin the next free cached victim, then evict it."""
        victims = [b for b in self.pool.iter_free_after(None) if self.held[b]]
        if not victims:
            return
        block_id = victims[0] if data.draw(st.booleans(), label="next") else victims[-1]
        self.pool.pin([block_id])
        self.pool.release_evicted(block_id)
        self.model_drop(block_id)

    @rule()
    def discard_all_keys(self) -> None:
        self.pool.discard_all_keys()
        for block_id in range(self.pool.num_blocks):
            self.model_drop(block_id)

    @rule()
    def reset(self) -> None:
        ok = self.pool.reset()
        assert ok == (not any(self.refs))
        if ok:
            for block_id in range(self.pool.num_blocks):
                self.model_drop(block_id)

    @rule()
    def take_events(self) -> None:
        for event in self.pool.take_events():
            if isinstance(event, AllCleared):
                removed = Counter(make_key(e.block_hash, e.group_id) for e in event.removed)
                assert removed == self.published, "AllCleared names other keys than were held"
                self.published.clear()
                continue
            key = make_key(event.block_hash, event.group_id)
            if isinstance(event, BlockRemoved):
                assert self.published[key] > 0, "a key removed more often than stored"
                self.published[key] -= 1
            else:
                self.published[key] += 1
        self.published = +self.published  # drop zero counts
        if self.events:
            held = Counter(key for keys in self.held for key in keys)
            assert self.published == held, "the events do not replay to the keys held"

    # ----------------------------------------------------------------- checks

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        for block_id in range(1, pool.num_blocks):
            assert pool.ref_count(block_id) == self.refs[block_id]
            assert [pool.key(block_id), *pool.secondary_keys(block_id)] == (
                self.held[block_id] or [None]
            ), f"block {block_id}"
            assert pool.tag(block_id) == self.tags[block_id], f"block {block_id}'s tag"
            for key in self.held[block_id]:
                want = self.stored.get((block_id, key)) if self.payloads else None
                assert pool.payload(block_id, key) == want, f"block {block_id}'s payload"
        for key in KEYS:
            holders = [b for b in range(pool.num_blocks) if key in self.held[b]]
            assert sorted(pool.cached_blocks(key)) == holders
        for block_id in pool.iter_free_after(None):
            noted = noted_key(self.policy, block_id)
            assert noted in ("n/a", pool.key(block_id)), f"policy's key of block {block_id}"
        assert len(self.policy) == self.refs[1:].count(0)
        assert self.evicted == self.expected_evicted

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.take_events()


PolicyEventsMachine.TestCase.settings = settings(
    max_examples=scaled_examples(300), stateful_step_count=40, deadline=None
)
TestPolicyEvents = PolicyEventsMachine.TestCase
