"""The whole-run store path (`store_runs.take_whole_run`) decides as the per-block loop.

`select_run` takes a run of plain blocks in one batch when set operations show that the
per-block loop would store every block up to the tier's free slots. These tests build
random selector states (keys repeated, in flight, in the tier, copied before in lazy
mode, unhashed blocks, null blocks, full tiers) and check that the batch and the loop
leave exactly the same state: return value, queued stores, store-outcome counters, keys
in flight, and both pools (keys, references, free order). Invariants are checked after.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_request import pool_states, store_selector

from example_counts import scaled_examples
from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.offload.stats import StoreOutcome
from kvtier.offload.store_runs import select_run, take_whole_run
from kvtier.offload.store_selection import StoreSelector

NUM_KEYS = 24  # few keys for many blocks: repeats, hits and in-flight keys are common


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"run%d" % i).digest(), 0)


@st.composite
def selector_and_run(draw: st.DrawFn) -> tuple[StoreSelector, list[int], int, int]:
    """Return a selector with random GPU, tier, in-flight and lazy state, a block table
    and the [pos, end) range to select from it."""
    gpu_keys = draw(  # one in five unhashed (None)
        st.lists(
            st.one_of(st.integers(0, NUM_KEYS - 1), st.integers(0, NUM_KEYS - 1), st.none()),
            min_size=1,
            max_size=20,
        )
    )
    gpu = BlockPool(len(gpu_keys) + 1)
    gpu_ids = gpu.allocate(len(gpu_keys))
    for block_id, i in zip(gpu_ids, gpu_keys, strict=True):
        if i is not None:
            gpu.insert_key(key(i), block_id, 4)
    tier = BlockPool(draw(st.integers(2, 20)))
    held = tier.allocate(draw(st.integers(0, tier.num_blocks - 1)))
    for block_id in held:  # often a key the run may hold
        tier_key = key(draw(st.integers(0, NUM_KEYS - 1) | st.sampled_from(gpu_keys)) or 0)
        if tier.cached_block(tier_key) is None:
            tier.insert_key(tier_key, block_id, 4)
    tier.free([b for b in held if draw(st.booleans())])  # the rest stay pinned
    selector = store_selector(gpu, tier)
    in_flight = draw(st.lists(st.sampled_from(gpu_keys), max_size=3))  # keys the run may hold
    selector.in_flight_keys.update(key(i) for i in in_flight if i is not None)
    for block_id in draw(st.lists(st.sampled_from(gpu_ids), max_size=3)):  # lazy copies
        other = draw(st.booleans()) and draw(st.booleans())  # one in four: another key
        copied = key(NUM_KEYS) if other else gpu.key(block_id)
        if copied is not None:
            selector.lazy.stored[block_id] = copied
    blocks = st.sampled_from([*gpu_ids, NULL_BLOCK_ID])
    # Half the tables hold each block once: the runs the whole-run path may take.
    table = draw(st.lists(blocks, max_size=20, unique=draw(st.booleans())))
    pos = draw(st.integers(0, len(table)))
    end = draw(st.integers(pos, len(table)))
    return selector, table, pos, end


def state(selector: StoreSelector, returned: int) -> tuple[Any, ...]:
    queued = selector.queued
    pools = pool_states(selector)
    return (
        returned,
        list(queued.gpu_block_ids),
        list(queued.tier_block_ids),
        list(queued.keys),
        dict(selector.counters.store_outcomes),
        sorted(selector.in_flight_keys),
        pools,
    )


def assert_same_as_the_loop(selector: StoreSelector, table: list[int], pos: int, end: int) -> None:
    batched, looped = copy.deepcopy(selector), copy.deepcopy(selector)
    assert state(batched, select_run(batched, table, pos, end)) == state(
        looped, select_run(looped, table, pos, end, whole_runs=False)
    )


@settings(max_examples=scaled_examples(600), deadline=None)
@given(selector_and_run())
def test_the_whole_run_path_leaves_what_the_per_block_loop_leaves(
    case: tuple[StoreSelector, list[int], int, int],
) -> None:
    assert_same_as_the_loop(*case)


@pytest.mark.parametrize("same", ["block", "key"])
def test_a_run_holding_a_key_twice_stores_it_once(same: str) -> None:
    """The second sighting of a key in one run is in flight (rare in random states)."""
    gpu = BlockPool(3)
    first, second = gpu.allocate(2)
    gpu.insert_key(key(0), first, 4)
    gpu.insert_key(key(0), second, 4)
    selector = store_selector(gpu, BlockPool(8))
    table = [first, first] if same == "block" else [first, second]
    assert_same_as_the_loop(selector, table, 0, 2)


def test_the_whole_run_path_is_taken_for_a_run_of_new_keys() -> None:
    """The common eager case: new keys, room for them all (the test above must cover it)."""
    gpu = BlockPool(5)
    gpu_ids = gpu.allocate(4)
    for i, block_id in enumerate(gpu_ids):
        gpu.insert_key(key(i), block_id, 4)
    selector = store_selector(gpu, BlockPool(8))
    assert take_whole_run(selector, gpu_ids, gpu.keys(gpu_ids)) == 4
    assert list(selector.queued.gpu_block_ids) == gpu_ids
    duplicate = [gpu_ids[0], gpu_ids[0]]
    assert take_whole_run(selector, duplicate, gpu.keys(duplicate)) is None  # in flight now


def test_a_run_holding_a_key_in_flight_stores_the_other_blocks_only() -> None:
    """A key already in flight (another request's store of the same prefix) is not
    stored twice: the whole-run path declines the run and the loop skips that block."""
    gpu = BlockPool(4)
    gpu_ids = gpu.allocate(3)
    for i, block_id in enumerate(gpu_ids):
        gpu.insert_key(key(i), block_id, 4)
    selector = store_selector(gpu, BlockPool(8))
    selector.in_flight_keys.add(key(1))
    assert take_whole_run(selector, gpu_ids, gpu.keys(gpu_ids)) is None
    assert select_run(selector, gpu_ids, 0, 3) == 3
    assert selector.queued.keys == [key(0), key(2)]
    assert selector.counters.store_outcomes == {"stored": 2, "skipped_in_flight": 1}


class AdmitEveryKey:
    """Admits every key, as `AdmitAll` does, without being one: `select_run` asks it."""

    name = "every"

    def __init__(self) -> None:
        self.asked = 0

    def admit(self, key: Key) -> bool:
        self.asked += 1
        return True

    def check_invariants(self) -> None:
        """Nothing to check."""


@settings(max_examples=scaled_examples(300), deadline=None)
@given(selector_and_run())
def test_admit_all_is_not_asked_and_selects_as_a_policy_asked_per_block(
    case: tuple[StoreSelector, list[int], int, int],
) -> None:
    """`select_run` skips asking `AdmitAll` (one call per block): the per-block loop then
    leaves what it leaves when an admit-everything policy is asked."""
    selector, table, pos, end = case
    asked = copy.deepcopy(selector)
    asked.admission = policy = AdmitEveryKey()
    assert state(selector, select_run(selector, table, pos, end, whole_runs=False)) == state(
        asked, select_run(asked, table, pos, end, whole_runs=False)
    )
    stored = selector.counters.store_outcomes.get(StoreOutcome.STORED.value, 0)
    assert policy.asked >= stored  # asked about every block it stored, at least
