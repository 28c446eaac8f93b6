"""Shortcuts on the per-request and per-step paths decide as the general code they skip.

- `StoreSelector.select_request` does not enter `_select_ready` when no group has a
  confirmed block past its cursor (most finishing requests in eager mode);
- `LazyWalk.note_blocks_in_use` forgets copied blocks by a set intersection, not by a
  pop per block in use;
- `TierIndex.cached_block` of one tier is its pool's key index's `get`;
- `pair_blocks` pairs a group's hit with its table by slices where neither holds a
  null block.

Each is compared with the general code on random states.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from sim_request import make_request, pool_states, store_selector

from example_counts import scaled_examples
from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.core.longest_hit import LongestHit
from kvtier.offload.lazy_walk import LazyWalk
from kvtier.offload.load_pairing import pair_blocks
from kvtier.offload.plan import Tier
from kvtier.offload.store_selection import StoreSelector
from kvtier.offload.tier_index import TierIndex

BLOCK = 4  # `store_selector`'s block size, in tokens


def selected(selector: StoreSelector, request_id: str) -> tuple[Any, ...]:
    """Return what a selection may change: its queue, counters, keys in flight, the
    request's cursors, and both pools."""
    state = selector.tracked[request_id]
    pools = pool_states(selector)
    return (
        list(selector.queued.gpu_block_ids),
        list(selector.queued.tier_block_ids),
        dict(selector.counters.store_outcomes),
        sorted(selector.in_flight_keys),
        list(state.cursors),
        list(state.deferred),
        state.next_ready,
        pools,
    )


@settings(max_examples=scaled_examples(400), deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    tier_blocks=st.integers(2, 10),
    first=st.integers(-1, 12),
    second=st.integers(-1, 12),
    final=st.booleans(),
)
def test_select_request_skips_only_what_select_ready_would_not_select(
    num_blocks: int, tier_blocks: int, first: int, second: int, final: bool
) -> None:
    """A request confirmed up to block `first`, selected (cursors move, a small tier
    stops them), then up to `second` (often nothing new): `select_request` leaves what
    `_select_ready` leaves, whether it skipped it or not."""
    request = make_request("r", range(num_blocks * BLOCK + 1))
    gpu = BlockPool(num_blocks + 1)
    table = gpu.allocate(num_blocks)
    for pos, block_id in enumerate(table):
        gpu.insert_key(make_key(request.block_hashes[pos], 0), block_id, BLOCK)
    selector = store_selector(gpu, BlockPool(tier_blocks))
    selector.track("r")
    selector.tracked["r"].block_ids[0].extend(table)
    request.num_computed_tokens = max(0, first * BLOCK)
    selector.select_request(request, selector.tracked["r"])
    request.num_computed_tokens = max(0, second * BLOCK + 1)  # not a whole block more
    shortcut, general = copy.deepcopy(selector), copy.deepcopy(selector)
    shortcut.select_request(request, shortcut.tracked["r"], final)
    ready = general.confirmed_tokens(request)
    general._select_ready(request, general.tracked["r"], ready, final)
    assert selected(shortcut, "r") == selected(general, "r")


def note_by_pops(walk: LazyWalk, block_ids_per_group: Iterable[Sequence[int]]) -> None:
    """`LazyWalk.note_blocks_in_use` as it was: a pop per block in use, from both maps."""
    for block_ids in block_ids_per_group:
        if walk.cursor is not None and walk.cursor in block_ids:
            walk.cursor = None
        if walk.stored and not walk.stored.keys().isdisjoint(block_ids):
            for block_id in block_ids:
                walk.stored.pop(block_id, None)
                walk.held.pop(block_id, None)
        walk.copying.difference_update(block_ids)
        walk.deferred.difference_update(block_ids)


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"walk%d" % i).digest(), 0)


ids = st.integers(1, 16)


@settings(max_examples=scaled_examples(400), deadline=None)
@given(
    stored=st.dictionaries(ids, st.integers(0, 3)),
    held=st.dictionaries(ids, st.integers(0, 3)),
    copying=st.sets(ids),
    deferred=st.sets(ids),
    cursor=st.none() | ids,
    in_use=st.lists(st.lists(ids, max_size=8), max_size=3),
)
def test_noting_blocks_in_use_forgets_what_a_pop_per_block_forgets(
    stored: dict[int, int],
    held: dict[int, int],
    copying: set[int],
    deferred: set[int],
    cursor: int | None,
    in_use: list[list[int]],
) -> None:
    """Random walks (held blocks in `stored` or not, repeated ids, empty groups)."""
    walk = LazyWalk(cursor, {b: key(i) for b, i in stored.items()}, copying, deferred)
    walk.held.update({b: key(i) for b, i in held.items()})
    expected = copy.deepcopy(walk)
    walk.note_blocks_in_use(in_use)
    note_by_pops(expected, in_use)
    assert (walk.cursor, walk.stored, walk.held, walk.copying, walk.deferred) == (
        expected.cursor,
        expected.stored,
        expected.held,
        expected.copying,
        expected.deferred,
    )


@settings(max_examples=scaled_examples(200), deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "evict", "discard", "reset"]), st.integers(0, 9)),
        max_size=30,
    )
)
def test_one_tier_index_looks_keys_up_as_its_pool(ops: list[tuple[str, int]]) -> None:
    """Keys stored, evicted by allocation, discarded and reset: the index's lookup is the
    pool's `cached_block` for every key, after every change."""
    pool = BlockPool(6)
    index = TierIndex([(Tier.CPU, pool)])
    for op, i in ops:
        if op == "store" and pool.cached_block(key(i)) is None and pool.num_free():
            (block_id,) = pool.allocate(1)
            pool.insert_key(key(i), block_id, BLOCK)
            pool.free([block_id])
        elif op == "evict" and pool.num_free():
            pool.free(pool.allocate(1))
        elif op == "discard":
            pool.discard_keys(i % (pool.num_blocks - 1) + 1)
        elif op == "reset":
            pool.reset()
        assert [index.cached_block(key(j)) for j in range(10)] == [
            pool.cached_block(key(j)) for j in range(10)
        ]


def pair_each(
    layout: KVLayout,
    num_local_tokens: int,
    hit: LongestHit,
    block_ids_per_group: Sequence[Sequence[int]],
    num_tokens: int,
) -> tuple[list[int], list[int]]:
    """`pair_blocks` as it was: each position paired in a loop (its length check left out)."""
    tier_ids: list[int] = []
    gpu_ids: list[int] = []
    for group_id in layout.cacheable_group_ids:
        block_size = layout.groups[group_id].block_size
        first = num_local_tokens // block_size
        table = block_ids_per_group[group_id]
        for i, tier_block in enumerate(hit.block_ids[group_id][: -(-num_tokens // block_size)]):
            if tier_block == NULL_BLOCK_ID:
                continue
            if table[first + i] == NULL_BLOCK_ID:
                raise ValueError(f"group {group_id}: load destination {first + i} is null")
            tier_ids.append(tier_block)
            gpu_ids.append(table[first + i])
    return tier_ids, gpu_ids


HYBRID = KVLayout(
    (
        KVGroupSpec(GroupKind.FULL_ATTENTION, BLOCK, 64),
        KVGroupSpec(GroupKind.SLIDING_WINDOW, BLOCK, 64, sliding_window=2 * BLOCK),
    )
)


@settings(max_examples=scaled_examples(400), deadline=None)
@given(
    local=st.integers(0, 4),
    hit=st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=2, max_size=2),
    tables=st.lists(st.lists(st.integers(0, 3), min_size=12, max_size=12), min_size=2, max_size=2),
    num_tokens=st.integers(1, 8 * BLOCK),
)
def test_pairing_a_hit_by_slices_pairs_as_a_loop_over_its_positions(
    local: int, hit: list[list[int]], tables: list[list[int]], num_tokens: int
) -> None:
    """Hits and tables with null blocks (skipped sources, refused destinations) or none
    (paired by slices), over a full-attention and a sliding-window group."""
    found = LongestHit(num_tokens, (tuple(hit[0]), tuple(hit[1])))
    args = (HYBRID, local * BLOCK, found, tables, num_tokens)
    try:
        expected: object = pair_each(*args)
    except ValueError as error:
        expected = str(error)
    try:
        got: object = pair_blocks(*args)
    except ValueError as error:
        got = str(error)
    assert got == expected
