"""Every eviction policy against a model: random operations on a `BlockPool`, checked
after every step.

Besides what `test_policies_stateful` drives, this machine stores through `insert_keys`
(the batched path), releases pins with `release_evicted` (the write-back demotion), and
keeps a model: the reference count and primary key of every block, and the free queue
in LRU order (unhashed blocks at the head, reused first; cached ones at the tail). After
every step:
- the pool's and the policy's `check_invariants()` hold, the counts and keys match;
- the listing (`iter_free_after`) is exactly what `allocate` takes, one by one;
- `lru`, and `duel` while it is in LRU order, list exactly the model's order;
- pinning the next victims and evicting them with `release_evicted` leaves the cached
  order and the policy's adaptive state (ARC's target and ghosts, S3-FIFO's ghost, the
  LFU-DA level) as `allocate` would (`demote_next_victims`).
"""

from __future__ import annotations

import copy
import hashlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from example_counts import scaled_examples
from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.free_queue import FreeQueue
from kvtier.core.keys import Key, make_key
from kvtier.core.policies import (
    EVICTION_POLICIES,
    ARCPolicy,
    DuelingPolicy,
    EvictionPolicy,
    LFUDAPolicy,
    S3FIFOPolicy,
)

KEYS: list[Key] = [make_key(hashlib.sha256(bytes([i])).digest(), 0) for i in range(14)]


def adaptive_state(policy: FreeQueue) -> tuple[object, ...]:
    """What a policy learns from its evictions: ghosts, ARC's target, the LFU-DA level."""
    if isinstance(policy, ARCPolicy):
        return (policy.target_t1, list(policy._b1), list(policy._b2))
    if isinstance(policy, S3FIFOPolicy):
        return (list(policy._ghost),)
    if isinstance(policy, LFUDAPolicy):
        return (policy.level,)
    if isinstance(policy, DuelingPolicy):
        return (policy.lfu_order, policy._lfu.level)
    return ()


def cached_order(pool: BlockPool) -> list[int]:
    """Return the free cached blocks in eviction order."""
    return [b for b in pool.iter_free_after(None) if pool.key(b) is not None]


class PolicyModelMachine(RuleBasedStateMachine):
    """A pool under one policy, its blocks' references and keys, and an LRU model queue."""

    pool: BlockPool
    policy: EvictionPolicy
    refs: list[int]
    keys: list[Key | None]
    lru: list[int]  # the free queue in LRU order, head first

    @initialize(
        name=st.sampled_from(sorted(EVICTION_POLICIES)),
        num_blocks=st.integers(2, 9),
        lfu_order=st.booleans(),
    )
    def make(self, name: str, num_blocks: int, lfu_order: bool) -> None:
        self.policy = EVICTION_POLICIES[name](num_blocks)
        if isinstance(self.policy, DuelingPolicy):
            self.policy.lfu_order = lfu_order
        self.pool = BlockPool(num_blocks, free_queue=self.policy)
        self.refs = [0] * num_blocks
        self.keys = [None] * num_blocks
        self.lru = list(range(1, num_blocks))

    # ----------------------------------------------------------------- model

    def in_lru_order(self) -> bool:
        policy = self.policy
        return policy.name == "lru" or (isinstance(policy, DuelingPolicy) and not policy.lfu_order)

    def held(self) -> list[int]:
        return [b for b in range(1, self.pool.num_blocks) if self.refs[b]]

    def model_take(self, block_id: int) -> None:
        """A reference on `block_id`; a free one leaves the queue."""
        if self.refs[block_id] == 0:
            self.lru.remove(block_id)
        self.refs[block_id] += 1

    def model_release(self, block_id: int) -> None:
        """One reference less; at 0 the block is queued by whether it is cached."""
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            self.model_queue(block_id)

    def model_queue(self, block_id: int) -> None:
        if self.keys[block_id] is None:
            self.lru.insert(0, block_id)
        else:
            self.lru.append(block_id)

    def model_store(self, key: Key, block_id: int) -> None:
        if self.keys[block_id] is not None:
            return  # a secondary key: nothing moves
        self.keys[block_id] = key
        if self.refs[block_id] == 0:  # free and unhashed: re-queued as most recent
            self.lru.remove(block_id)
            self.lru.append(block_id)

    def model_drop_keys(self, block_id: int) -> None:
        """A free cached block's keys go: it is reused first."""
        self.keys[block_id] = None
        self.lru.remove(block_id)
        self.lru.insert(0, block_id)

    # ----------------------------------------------------------------- rules

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        num = data.draw(st.integers(0, len(self.lru)), label="num")
        expected = self.lru[:num] if self.in_lru_order() else None
        taken = self.pool.allocate(num)
        if expected is not None:
            assert taken == expected, "LRU order evicted another block"
        for block_id in taken:
            assert self.refs[block_id] == 0, f"allocate handed out referenced block {block_id}"
            self.lru.remove(block_id)
            self.refs[block_id] = 1
            self.keys[block_id] = None

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=3))
        self.pool.touch(ids)
        for block_id in ids:
            if block_id != NULL_BLOCK_ID:
                self.model_take(block_id)

    @rule(key=st.sampled_from(KEYS))
    def hit(self, key: Key) -> None:
        """A lookup that hits: the block is touched, loaded and released."""
        block_id = self.pool.cached_block(key)
        if block_id is None:
            return
        self.pool.touch([block_id])
        self.pool.free([block_id])
        self.model_take(block_id)
        self.model_release(block_id)

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(1, self.pool.num_blocks - 1), max_size=3))
        self.pool.pin(ids)
        for block_id in ids:
            self.model_take(block_id)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = self.held()
        if not held:
            return
        ids = data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True))
        self.pool.free(ids)
        for block_id in ids:
            self.model_release(block_id)

    @rule(data=st.data())
    def insert_keys(self, data: st.DataObject) -> None:
        """A step's stores on referenced blocks, batched (a block may come twice)."""
        held = self.held()
        if not held:
            return
        ids = data.draw(st.lists(st.sampled_from(held), max_size=4), label="ids")
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=len(ids), max_size=len(ids)))
        self.pool.insert_keys(keys, ids, [16] * len(ids))
        for key, block_id in zip(keys, ids, strict=True):
            self.model_store(key, block_id)

    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def insert_key_anywhere(self, data: st.DataObject, key: Key) -> None:
        block_id = data.draw(st.integers(1, self.pool.num_blocks - 1), label="block_id")
        self.pool.insert_key(key, block_id, 16)
        self.model_store(key, block_id)

    @rule(data=st.data())
    def discard_keys(self, data: st.DataObject) -> None:
        block_id = data.draw(st.integers(1, self.pool.num_blocks - 1), label="block_id")
        self.pool.discard_keys(block_id)
        if self.keys[block_id] is not None:
            if self.refs[block_id]:
                self.keys[block_id] = None
            else:
                self.model_drop_keys(block_id)

    @rule(data=st.data())
    def evict_keys(self, data: st.DataObject) -> None:
        """A free cached block moved down a tier."""
        free_cached = [b for b in self.lru if self.keys[b] is not None]
        if not free_cached:
            return
        block_id = data.draw(st.sampled_from(free_cached), label="block_id")
        self.pool.evict_keys(block_id)
        self.model_drop_keys(block_id)

    @rule(data=st.data())
    def release_evicted(self, data: st.DataObject) -> None:
        """The last reference of a cached block dropped and the block evicted at once."""
        held = [b for b in self.held() if self.refs[b] == 1 and self.keys[b] is not None]
        if not held:
            return
        block_id = data.draw(st.sampled_from(held), label="block_id")
        self.pool.release_evicted(block_id)
        self.refs[block_id] = 0
        self.keys[block_id] = None
        self.lru.insert(0, block_id)

    @rule(data=st.data())
    def demote_next_victims(self, data: st.DataObject) -> None:
        """Write-back: pin the next cached victims listed, then `release_evicted` them."""
        cached = cached_order(self.pool)
        if not cached:
            return
        victims = cached[: data.draw(st.integers(1, len(cached)), label="num")]
        by_allocate = copy.deepcopy(self.pool)
        num_unhashed = self.pool.num_free() - len(cached)
        taken = by_allocate.allocate(num_unhashed + len(victims))
        assert taken[num_unhashed:] == victims, "the listing is not the eviction order"
        self.pool.pin(victims)
        for block_id in victims:
            self.model_take(block_id)
        for block_id in victims:
            self.pool.release_evicted(block_id)
            self.refs[block_id] = 0
            self.keys[block_id] = None
            self.lru.insert(0, block_id)
        assert cached_order(self.pool) == cached_order(by_allocate)
        assert adaptive_state(self.policy) == adaptive_state(by_allocate._free)

    @rule()
    def reset(self) -> None:
        done = self.pool.reset()
        assert done == (not self.held())
        if done:
            self.keys = [None] * self.pool.num_blocks
            self.lru = list(range(1, self.pool.num_blocks))

    # ----------------------------------------------------------------- checks

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        for block_id in range(1, pool.num_blocks):
            assert pool.ref_count(block_id) == self.refs[block_id]
            assert pool.key(block_id) == self.keys[block_id]
        listed = list(pool.iter_free_after(None))
        assert sorted(listed) == sorted(self.lru)
        if self.in_lru_order():
            assert listed == self.lru, "LRU order differs from the model"
        drained = copy.deepcopy(pool)
        assert [drained.allocate(1)[0] for _ in listed] == listed


PolicyModelMachine.TestCase.settings = settings(
    max_examples=scaled_examples(120), stateful_step_count=40, deadline=None
)
TestPolicyModel = PolicyModelMachine.TestCase
