"""Store runs into a disk-only tier that holds slots of failed stores (`disk_slots`).

`select_run`'s per-block loop and `take_whole_run`'s set operations must give the held
slots back at the same point (when the run needs more slots than are free) and leave
the same state, set-aside slots included; a held slot is never handed out while held
nor given a key.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from sim_request import store_selector

from example_counts import scaled_examples
from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.offload.disk_slots import SetAsideSlots
from kvtier.offload.store_runs import select_run
from kvtier.offload.store_selection import StoreSelector


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"held%d" % i).digest(), 0)


@st.composite
def held_case(draw: st.DrawFn) -> tuple[StoreSelector, list[int]]:
    """A selector whose disk holds some slots of failed stores, and a run of new keys
    (some repeated or already stored, so both paths are taken)."""
    num_run = draw(st.integers(1, 12))
    gpu = BlockPool(num_run + 1)
    gpu_ids = gpu.allocate(num_run)
    for block_id in gpu_ids:
        gpu.insert_key(key(draw(st.integers(0, 30))), block_id, 4)
    tier = BlockPool(draw(st.integers(2, 14)))
    taken = tier.allocate(draw(st.integers(0, tier.num_blocks - 1)))
    selector = store_selector(gpu, tier)
    selector.set_aside = SetAsideSlots(tier)
    num_failed = draw(st.integers(0, len(taken)))
    selector.set_aside.note_failed(taken[:num_failed])  # held: one reference each
    rest = taken[num_failed:]
    for block_id in rest:
        stored = key(draw(st.integers(0, 30)))
        if tier.cached_block(stored) is None:
            tier.insert_key(stored, block_id, 4)
    tier.free([b for b in rest if draw(st.booleans())])  # the rest stay pinned
    if draw(st.booleans()) and selector.set_aside.suspects:  # some given back on trial
        selector.set_aside.note_succeeded([])
    return selector, draw(st.lists(st.sampled_from(gpu_ids), min_size=1, max_size=12))


def state(selector: StoreSelector, returned: int) -> tuple[Any, ...]:
    set_aside = selector.set_aside
    assert set_aside is not None
    set_aside.check_invariants()
    tier = selector.tier_pool
    tier.check_invariants()
    held = set(set_aside.held())
    assert not held.intersection(selector.queued.tier_block_ids), "a held slot handed out"
    return (
        returned,
        list(selector.queued.gpu_block_ids),
        list(selector.queued.tier_block_ids),
        dict(selector.counters.store_outcomes),
        list(set_aside.suspects),
        list(set_aside.bad),
        sorted(set_aside.on_trial),
        list(tier._refs),
        list(tier._free.iter_after(None)),
    )


@settings(max_examples=scaled_examples(500), deadline=None)
@given(held_case())
def test_held_slots_come_back_at_the_same_point_in_both_run_paths(
    case: tuple[StoreSelector, list[int]],
) -> None:
    selector, table = case
    batched, looped = copy.deepcopy(selector), copy.deepcopy(selector)
    assert state(batched, select_run(batched, table, 0, len(table))) == state(
        looped, select_run(looped, table, 0, len(table), whole_runs=False)
    )


def test_a_run_longer_than_the_free_slots_takes_the_held_ones() -> None:
    gpu = BlockPool(7)
    gpu_ids = gpu.allocate(6)
    for i, block_id in enumerate(gpu_ids):
        gpu.insert_key(key(i), block_id, 4)
    tier = BlockPool(7)  # 6 usable: 3 held, 3 free
    selector = store_selector(gpu, tier)
    selector.set_aside = SetAsideSlots(tier)
    selector.set_aside.note_failed(tier.allocate(3))
    for whole in (True, False):
        trial = copy.deepcopy(selector)
        assert select_run(trial, gpu_ids[:4], 0, 4, whole_runs=whole) == 4
        assert len(trial.queued) == 4
        assert trial.set_aside is not None
        assert not trial.set_aside.held()
        trial = copy.deepcopy(selector)
        assert select_run(trial, gpu_ids[:3], 0, 3, whole_runs=whole) == 3
        assert trial.set_aside is not None
        assert len(trial.set_aside.held()) == 3  # kept: the run fits the free slots
