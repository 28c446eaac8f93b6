"""Random operation sequences on BlockPool against an independent model (SPEC §4)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from example_counts import scaled_examples
from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool, PoolError
from kvtier.core.events import AllCleared, BlockRemoved, BlockStored, KVEvent
from kvtier.core.keys import Key, key_block_hash, make_key

# A small key universe so that keys collide across blocks (a key held by several blocks).
KEYS = [
    make_key(hashlib.sha256(str(i).encode()).digest(), group_id)
    for i in range(5)
    for group_id in (0, 1)
]
GROUP_OF = {key: i % 2 for i, key in enumerate(KEYS)}


class BlockPoolModel:
    """The pool's expected state as plain lists and dicts, written independently of it."""

    def __init__(self, num_blocks: int, medium: str | None, events: bool) -> None:
        self.num_blocks = num_blocks
        self.medium = medium
        self.events = events
        self.refs = [0] * num_blocks
        self.free = list(range(1, num_blocks))  # head (next victim) first
        self.keys: dict[int, list[Key]] = {}  # block -> [primary, *secondaries]
        self.num_tokens: dict[int, int] = {}
        self.pending: list[KVEvent] = []

    def holders(self, key: Key) -> set[int]:
        return {b for b, keys in self.keys.items() if key in keys}

    def drop_keys(self, block_id: int) -> None:
        for key in self.keys.pop(block_id, []):
            self.record(BlockRemoved(key_block_hash(key), GROUP_OF[key], self.medium))
        self.num_tokens.pop(block_id, None)

    def record(self, event: KVEvent) -> None:
        if self.events:
            self.pending.append(event)


class BlockPoolMachine(RuleBasedStateMachine):
    """Drive a BlockPool and the model with the same operations and compare them."""

    pool: BlockPool
    model: BlockPoolModel

    @initialize(
        num_blocks=st.integers(2, 9),
        medium=st.sampled_from([None, "CPU", "DISK"]),
        events=st.booleans(),
    )
    def make(self, num_blocks: int, medium: str | None, events: bool) -> None:
        self.pool = BlockPool(num_blocks, medium=medium, record_events=events)
        self.model = BlockPoolModel(num_blocks, medium, events)

    def block_ids(self, max_size: int = 5) -> st.SearchStrategy[list[int]]:
        return st.lists(st.integers(0, self.model.num_blocks - 1), max_size=max_size)

    # --------------------------------------------------------------- shared steps

    def do_allocate(self, num: int) -> list[int]:
        model = self.model
        expected, model.free = model.free[:num], model.free[num:]
        for block_id in expected:
            model.drop_keys(block_id)
            model.refs[block_id] = 1
        block_ids = self.pool.allocate(num)
        assert block_ids == expected
        return block_ids

    def do_free(self, block_ids: list[int]) -> None:
        model = self.model
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            model.refs[block_id] -= 1
            if model.refs[block_id] == 0:
                if block_id in model.keys:
                    model.free.append(block_id)
                else:
                    model.free.insert(0, block_id)
        self.pool.free(block_ids)

    def do_insert_key(self, key: Key, block_id: int, num_tokens: int) -> None:
        self.model_insert_key(key, block_id, num_tokens)
        self.pool.insert_key(key, block_id, num_tokens)

    def model_insert_key(self, key: Key, block_id: int, num_tokens: int) -> None:
        model = self.model
        held = model.keys.setdefault(block_id, [])
        if key not in held:
            if not held:
                model.num_tokens[block_id] = num_tokens
                if model.refs[block_id] == 0:  # a free block, once cached, is queued as MRU
                    model.free.remove(block_id)
                    model.free.append(block_id)
            held.append(key)
            model.record(
                BlockStored(key_block_hash(key), GROUP_OF[key], num_tokens, medium=model.medium)
            )

    # --------------------------------------------------------------- operations

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        self.do_allocate(data.draw(st.integers(0, len(self.model.free)), label="num"))

    @rule(extra=st.integers(1, 2))
    def allocate_too_many_raises(self, extra: int) -> None:
        with pytest.raises(PoolError, match="only"):
            self.pool.allocate(len(self.model.free) + extra)

    @precondition(lambda self: len(self.model.free) > 0)
    @rule(data=st.data())
    def cache_request(self, data: st.DataObject) -> None:
        """Allocate a request's blocks, give each one or two keys, free them tail-first."""
        num = data.draw(st.integers(1, min(3, len(self.model.free))), label="num")
        block_ids = self.do_allocate(num)
        for block_id in block_ids:
            for key in data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=2)):
                self.do_insert_key(key, block_id, 16)
        self.do_free(block_ids[::-1])

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        block_ids = data.draw(self.block_ids(), label="block_ids")
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            if self.model.refs[block_id] == 0:
                self.model.free.remove(block_id)
            self.model.refs[block_id] += 1
        self.pool.touch(block_ids)

    @precondition(lambda self: any(self.model.refs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        model = self.model
        held = [b for b in range(1, model.num_blocks) for _ in range(model.refs[b])]
        block_ids = data.draw(st.permutations(held), label="order")
        block_ids = block_ids[: data.draw(st.integers(1, len(block_ids)), label="num")]
        if data.draw(st.booleans(), label="with_null"):
            block_ids.insert(len(block_ids) // 2, NULL_BLOCK_ID)
        self.do_free(block_ids)

    @precondition(lambda self: len(self.model.free) > 0)
    @rule(data=st.data())
    def free_unreferenced_block_raises(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.model.free), label="block_id")
        with pytest.raises(PoolError):
            self.pool.free([block_id])

    @rule(data=st.data(), key=st.sampled_from(KEYS), num_tokens=st.sampled_from([4, 16]))
    def insert_key(self, data: st.DataObject, key: Key, num_tokens: int) -> None:
        block_id = data.draw(st.integers(0, self.model.num_blocks - 1), label="block_id")
        if block_id == NULL_BLOCK_ID:
            with pytest.raises(PoolError):
                self.pool.insert_key(key, block_id, num_tokens)
        else:
            self.do_insert_key(key, block_id, num_tokens)

    @rule(data=st.data())
    def insert_keys(self, data: st.DataObject) -> None:
        """The batched insert equals insert_key one by one (any blocks, free ones too)."""
        entries = data.draw(
            st.lists(
                st.tuples(
                    st.sampled_from(KEYS),
                    st.integers(1, self.model.num_blocks - 1),
                    st.sampled_from([4, 16]),
                ),
                max_size=4,
            ),
            label="entries",
        )
        for key, block_id, num_tokens in entries:
            self.model_insert_key(key, block_id, num_tokens)
        keys = [key for key, _, _ in entries]
        block_ids = [block_id for _, block_id, _ in entries]
        counts = [num_tokens for _, _, num_tokens in entries]
        self.pool.insert_keys(keys, block_ids, counts)

    @rule(data=st.data())
    def discard_keys(self, data: st.DataObject) -> None:
        """Dropping a block's keys: a free one moves to the head, to be reused first."""
        model = self.model
        block_id = data.draw(st.integers(0, model.num_blocks - 1), label="block_id")
        if model.keys.get(block_id):
            model.drop_keys(block_id)
            if model.refs[block_id] == 0:
                model.free.remove(block_id)
                model.free.insert(0, block_id)
        model.keys.pop(block_id, None)
        self.pool.discard_keys(block_id)

    @rule(data=st.data())
    def bad_block_ids_raise_and_change_nothing(self, data: st.DataObject) -> None:
        """Ids past the end, negative or not ints: touch, free and insert_key refuse them."""
        n = self.model.num_blocks
        bad = data.draw(st.sampled_from([n, n + 3, -1, 1.5, "1", None]), label="bad")
        with pytest.raises(PoolError):
            self.pool.touch([bad])
        with pytest.raises(PoolError):
            self.pool.free([bad])
        with pytest.raises(PoolError):
            self.pool.insert_key(KEYS[0], bad, 16)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def lookup(self, keys: list[Key]) -> None:
        found = self.pool.lookup(keys)
        num_hits = 0
        while num_hits < len(keys) and self.model.holders(keys[num_hits]):
            num_hits += 1
        assert len(found) == num_hits
        for key, block_id in zip(keys, found, strict=False):
            assert block_id in self.model.holders(key)

    @rule(data=st.data())
    def iter_free_after(self, data: st.DataObject) -> None:
        model = self.model
        cursor = data.draw(st.none() | st.integers(0, model.num_blocks - 1), label="cursor")
        expected = model.free
        if cursor is not None and cursor in model.free:
            expected = model.free[model.free.index(cursor) + 1 :]
        assert list(self.pool.iter_free_after(cursor)) == expected

    @rule()
    def reset(self) -> None:
        model = self.model
        if any(model.refs):
            assert self.pool.reset() is False
            return
        model.keys.clear()
        model.num_tokens.clear()
        model.free = list(range(1, model.num_blocks))
        model.record(AllCleared(model.medium))
        assert self.pool.reset() is True

    @rule()
    def take_events(self) -> None:
        assert self.pool.take_events() == self.model.pending
        self.model.pending = []

    # --------------------------------------------------------------- comparisons

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.take_events()  # events still queued at the end must match too

    @invariant()
    def pool_matches_model(self) -> None:
        pool, model = self.pool, self.model
        pool.check_invariants()
        assert list(pool.iter_free_after(None)) == model.free
        assert pool.num_free() == len(model.free)
        for block_id in range(model.num_blocks):
            held = model.keys.get(block_id, [])
            assert pool.ref_count(block_id) == model.refs[block_id]
            assert pool.key(block_id) == (held[0] if held else None)
            assert list(pool.secondary_keys(block_id)) == held[1:]
            assert pool.num_tokens(block_id) == model.num_tokens.get(block_id, 0)
        for key in KEYS:
            holders = model.holders(key)
            assert set(pool.cached_blocks(key)) == holders
            assert len(pool.cached_blocks(key)) == len(holders)
            first = pool.cached_block(key)
            assert first in holders if holders else first is None


BlockPoolMachine.TestCase.settings = settings(
    max_examples=scaled_examples(300), stateful_step_count=40, deadline=None
)
test_block_pool_matches_model = BlockPoolMachine.TestCase
