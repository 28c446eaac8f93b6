"""Every eviction policy keeps the pool correct: random operations on a `BlockPool`.

A referenced block is never handed out by `allocate` (pins are respected), a pinned
cached block keeps its key, and the pool's and the policy's `check_invariants()` hold
after every operation (the pool's check runs the policy's). Besides the pool's plain
operations: keys given to free blocks, `discard_keys`, `pin`, `evict_keys`, iteration
from any cursor, and calls that must fail (too many blocks, double free, bad ids)
without changing anything.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from example_counts import scaled_examples
from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool, PoolError
from kvtier.core.keys import Key, make_key
from kvtier.core.policies import EVICTION_POLICIES, DuelingPolicy, EvictionPolicy

KEYS: list[Key] = [make_key(hashlib.sha256(bytes([i])).digest(), 0) for i in range(12)]


class PolicyPoolMachine(RuleBasedStateMachine):
    """Drive a BlockPool whose free queue is a policy; track references independently."""

    pool: BlockPool
    policy: EvictionPolicy
    refs: list[int]

    @initialize(
        name=st.sampled_from(sorted(EVICTION_POLICIES)),
        num_blocks=st.integers(2, 10),
        lfu_order=st.booleans(),
    )
    def make(self, name: str, num_blocks: int, lfu_order: bool) -> None:
        self.policy = EVICTION_POLICIES[name](num_blocks)
        if isinstance(self.policy, DuelingPolicy):
            self.policy.lfu_order = lfu_order  # exercise both of its orders
        self.pool = BlockPool(num_blocks, free_queue=self.policy)
        self.refs = [0] * num_blocks

    def referenced(self) -> list[int]:
        return [b for b in range(1, self.pool.num_blocks) if self.refs[b] > 0]

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        num_free = self.refs[1:].count(0)
        num = data.draw(st.integers(0, num_free), label="num")
        taken = self.pool.allocate(num)
        assert len(set(taken)) == num
        for block_id in taken:
            assert block_id != NULL_BLOCK_ID
            assert self.refs[block_id] == 0, f"allocate handed out pinned block {block_id}"
            assert self.pool.key(block_id) is None, "an allocated block kept its key"
            self.refs[block_id] = 1

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=4))
        self.pool.touch(ids)
        for block_id in ids:
            if block_id != NULL_BLOCK_ID:
                self.refs[block_id] += 1

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = self.referenced()
        if not held:
            return
        ids = data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True))
        self.pool.free(ids)
        for block_id in ids:
            self.refs[block_id] -= 1

    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def store(self, data: st.DataObject, key: Key) -> None:
        held = self.referenced()
        if not held:
            return
        block_id = data.draw(st.sampled_from(held))
        had_primary = self.pool.key(block_id) is not None
        self.pool.insert_key(key, block_id, 16)
        if not had_primary:
            self.policy.note_key(block_id, key)

    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def store_on_any_block(self, data: st.DataObject, key: Key) -> None:
        """A key given to any block, free ones included (the pool re-queues those)."""
        block_id = data.draw(st.integers(1, self.pool.num_blocks - 1), label="block_id")
        self.pool.insert_key(key, block_id, 16)

    @rule(data=st.data())
    def discard_keys(self, data: st.DataObject) -> None:
        """A block's copy is no longer trusted: its keys go, a free one is reused first."""
        block_id = data.draw(st.integers(0, self.pool.num_blocks - 1), label="block_id")
        had_key = self.pool.key(block_id) is not None
        self.pool.discard_keys(block_id)
        assert self.pool.key(block_id) is None
        if had_key and not self.refs[block_id]:
            assert next(self.pool.iter_free_after(None)) == block_id

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        """A copy reads blocks (a demotion's source): a reference, no hit."""
        ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=4))
        self.pool.pin(ids)
        for block_id in ids:
            if block_id != NULL_BLOCK_ID:
                self.refs[block_id] += 1

    @rule(data=st.data())
    def evict_keys(self, data: st.DataObject) -> None:
        """A free cached block moved down a tier: evicted as the policy evicts; a block
        in use is refused and keeps its keys."""
        block_id = data.draw(st.integers(0, self.pool.num_blocks - 1), label="block_id")
        key = self.pool.key(block_id)
        if key is not None and self.refs[block_id]:
            with pytest.raises(PoolError, match="in use"):
                self.pool.evict_keys(block_id)
            assert self.pool.key(block_id) == key
            return
        self.pool.evict_keys(block_id)
        assert self.pool.key(block_id) is None
        if key is not None:
            assert next(self.pool.iter_free_after(None)) == block_id

    @rule(data=st.data())
    def iter_free_after(self, data: st.DataObject) -> None:
        """Iterating from any cursor yields free blocks only, each once."""
        cursor = data.draw(st.none() | st.integers(0, self.pool.num_blocks - 1), label="cursor")
        blocks = list(self.pool.iter_free_after(cursor))
        assert len(set(blocks)) == len(blocks)
        assert all(self.refs[b] == 0 and b != NULL_BLOCK_ID for b in blocks)

    @rule(extra=st.integers(1, 2))
    def allocate_too_many_raises(self, extra: int) -> None:
        with pytest.raises(PoolError, match="only"):
            self.pool.allocate(self.refs[1:].count(0) + extra)

    @rule(data=st.data())
    def free_of_a_free_block_raises(self, data: st.DataObject) -> None:
        free = [b for b in range(1, self.pool.num_blocks) if not self.refs[b]]
        if free:
            with pytest.raises(PoolError, match="freed more often"):
                self.pool.free([data.draw(st.sampled_from(free), label="block_id")])

    @rule(bad=st.sampled_from([-1, 1.5, None, 99]))
    def bad_block_ids_raise(self, bad: object) -> None:
        with pytest.raises(PoolError):
            self.pool.touch([bad])  # type: ignore[list-item]
        with pytest.raises(PoolError):
            self.pool.free([bad])  # type: ignore[list-item]

    @rule()
    def reset(self) -> None:
        ok = self.pool.reset()
        assert ok == (not self.referenced())

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        self.policy.check_invariants()
        for block_id in range(1, self.pool.num_blocks):
            assert self.pool.ref_count(block_id) == self.refs[block_id]
        assert len(self.policy) == self.refs[1:].count(0)
        free = list(self.pool.iter_free_after(None))
        assert sorted(free) == [b for b in range(1, self.pool.num_blocks) if not self.refs[b]]


PolicyPoolMachine.TestCase.settings = settings(
    max_examples=scaled_examples(150), stateful_step_count=40, deadline=None
)
TestPolicyPool = PolicyPoolMachine.TestCase
