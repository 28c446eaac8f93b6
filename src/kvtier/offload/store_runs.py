"""Selecting a run of plain GPU blocks for the tier in one batch: the hot path of eager
and lazy store selection (`StoreSelector`, store_selection.py).

`select_run` applies the same rules as `StoreSelector.try_select` to each block of a run
(no null block, no payload recorded), then pins, allocates and queues the accepted ones
together. `take_whole_run` is its common eager case, decided by set operations in C.
`count_unselected` counts the blocks a full tier left of a finished request's run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import Key
from kvtier.core.policies import AdmitAll
from kvtier.core.token_tags import Tag
from kvtier.offload.block_payload import request_key
from kvtier.offload.protocols import RequestView
from kvtier.offload.request_tags import TagOf
from kvtier.offload.stats import StoreOutcome

if TYPE_CHECKING:
    from kvtier.offload.store_selection import StoreSelector


def select_run(
    selector: StoreSelector,
    table: Sequence[int],
    pos: int,
    end: int,
    tag_of: TagOf | None = None,
    whole_runs: bool = True,
    known_keys: list[Key | None] | None = None,
) -> int:
    """Select positions from `pos` up to the first null block, `end`, or a full tier.

    One batched key read, touch and allocation for the run. Returns the first unvisited
    position. `tag_of` gives a position's tag (the token check on). The caller counts
    the block a full tier stops at (deferred, or dropped at a finish). `whole_runs`
    False: every block goes through the per-block loop (tests compare the two).
    `known_keys`: the keys of `table[pos:end]`, when the caller read them already (lazy
    mode's walk).
    """
    run = table[pos:end]
    run_keys = selector.gpu_pool.keys(run) if known_keys is None else known_keys
    if NULL_BLOCK_ID in run:
        cut = run.index(NULL_BLOCK_ID)
        run, run_keys = run[:cut], run_keys[:cut]
    if tag_of is None and whole_runs:
        num_taken = take_whole_run(selector, run, run_keys)
        if num_taken is not None:
            return pos + num_taken
    in_flight = selector.in_flight_keys
    tier_index = selector.tier_pool.index
    room = selector.tier_pool.num_free()
    # The default policy admits every key: not asked (a call per block saved).
    admit = None if type(selector.admission) is AdmitAll else selector.admission.admit
    stored_before = selector.lazy.stored  # empty in eager mode
    gpu_ids: list[int] = []
    keys: list[Key] = []
    tags: dict[int, Tag] = {}
    num_unhashed = num_in_flight = num_refused = num_cached = num_stored_before = 0
    num_untagged = 0
    num_visited = len(run)
    tag = None
    for i, (gpu_block_id, key) in enumerate(zip(run, run_keys, strict=True)):
        if key is None:
            num_unhashed += 1
            continue
        if tag_of is not None:  # every visited fill is noted, stored or not
            tag = tag_of(pos + i, gpu_block_id, key)
        if key in in_flight:
            num_in_flight += 1
        elif key in tier_index and not (tag is not None and selector.replace_untagged(key)):
            num_cached += 1
        elif stored_before and stored_before.get(gpu_block_id) == key:
            num_stored_before += 1  # the tier evicted this block's copy: not again
        elif admit is not None and not admit(key):
            num_refused += 1
        elif tag_of is not None and tag is None:
            num_untagged += 1  # never served with the check on: not worth a slot
        else:
            if len(gpu_ids) == room:  # out of room: held disk slots may come back
                room = selector.tier_room(room + 1)
                if len(gpu_ids) == room:
                    num_visited = i
                    break
            in_flight.add(key)
            if tag is not None:
                tags[len(keys)] = tag
            gpu_ids.append(gpu_block_id)
            keys.append(key)
    if gpu_ids:
        selector.gpu_pool.touch(gpu_ids)
        tier_ids = selector.tier_pool.allocate(len(gpu_ids))
        selector.queued.extend(gpu_ids, tier_ids, keys, tags)
        selector.note_counts(len(selector.queued) - len(gpu_ids))
    count_many = selector.counters.count_many
    count_many(StoreOutcome.STORED, len(gpu_ids))
    count_many(StoreOutcome.ALREADY_CACHED, num_cached)
    count_many(StoreOutcome.UNHASHED, num_unhashed)
    count_many(StoreOutcome.IN_FLIGHT, num_in_flight)
    count_many(StoreOutcome.NOT_ADMITTED, num_refused)
    count_many(StoreOutcome.STORED_BEFORE, num_stored_before)
    count_many(StoreOutcome.NO_TAG, num_untagged)
    return pos + num_visited


def take_whole_run(
    selector: StoreSelector, run: Sequence[int], keys: list[Key | None]
) -> int | None:
    """Store the run's first blocks, as many as the tier has slots for, when every one
    of them would be stored, and return how many; None (nothing done) otherwise.

    The common eager case, with the per-block rules checked by set operations in C:
    every key is set, distinct, neither in flight nor in the tier, and needs no
    admission check, and no block is one lazy mode copied before. Then `select_run`'s
    loop would store the blocks in order until the tier is full, and count exactly that.
    """
    if (
        not run
        or type(selector.admission) is not AdmitAll
        or not selector.lazy.stored.keys().isdisjoint(run)
    ):
        return None
    distinct = set(keys)
    if (
        len(distinct) != len(keys)
        or None in distinct
        or not selector.in_flight_keys.isdisjoint(distinct)
        or not selector.tier_pool.index.keys().isdisjoint(distinct)
    ):
        return None
    num_stored = min(len(run), selector.tier_room(len(run)))
    if num_stored:
        gpu_ids = run[:num_stored]
        stored_keys = cast("list[Key]", keys[:num_stored])
        selector.in_flight_keys.update(stored_keys)
        selector.gpu_pool.touch(gpu_ids)
        selector.queued.extend(gpu_ids, selector.tier_pool.allocate(num_stored), stored_keys)
        selector.note_counts(len(selector.queued) - num_stored)
        selector.counters.count_many(StoreOutcome.STORED, num_stored)
    return num_stored


def count_unselected(
    selector: StoreSelector,
    request: RequestView,
    group_id: int,
    table: Sequence[int],
    pos: int,
    end: int,
) -> None:
    """Count the outcome of each position in [pos, end) a full tier left unselected
    (a finished request's, never retried): a block that needed a slot is dropped.

    Nothing is asked of the admission policy or noted for the token check: blocks a
    full tier stops at were never offered, and offering them has side effects.
    """
    count = selector.counters.count_store
    in_flight, tier_index = selector.in_flight_keys, selector.tier_pool.index
    for i in range(pos, end):
        gpu_block_id = table[i]
        if gpu_block_id == NULL_BLOCK_ID:
            key = request_key(selector.layout, request, group_id, i)
            if key is None or selector.gpu_pool.cached_block(key) is None:
                count(StoreOutcome.NULL)
                continue
        else:
            key = selector.gpu_pool.key(gpu_block_id)
        if key is None:
            count(StoreOutcome.UNHASHED)
        elif key in in_flight:
            count(StoreOutcome.IN_FLIGHT)
        elif key in tier_index:
            count(StoreOutcome.ALREADY_CACHED)
        else:
            count(StoreOutcome.TIER_FULL)
