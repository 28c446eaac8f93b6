"""State blocks keyed inside their block are never stored (`offload.partial_states`).

A state group whose block spans several hash blocks is served by whole blocks only; a
block of it keyed at a hash boundary inside it (vLLM's Mamba "align" partial tail, whose
copy a failed step may leave unfilled in the free queue) is dropped by the lazy walk and
by hand-offs, and counted `dropped_partial_state`.
"""

from __future__ import annotations

import hashlib

import pytest

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.partial_states import is_partial_state
from kvtier.offload.protocols import Handoff
from kvtier.offload.stats import StepCounters
from kvtier.offload.store_selection import StoreSelector


def key(i: int, group_id: int) -> Key:
    return make_key(hashlib.sha256(b"partial%d" % i).digest(), group_id)


def layout(state_block_size: int) -> KVLayout:
    """Full attention of 8-token blocks beside a state group, 4-token hash blocks."""
    return KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 8, 64),
            KVGroupSpec(GroupKind.STATE, state_block_size, 64),
        ),
        configured_hash_block_size=4,
    )


def selector(state_block_size: int, num_tier_blocks: int = 8, unhashed: int = 0) -> StoreSelector:
    """Free GPU blocks, in eviction order: `unhashed` unhashed ones, a state keyed
    half-way into its block (4 of 8 tokens), a whole state, a full-attention block keyed
    half-way (a partial tail)."""
    gpu = BlockPool(4 + unhashed)
    blocks = gpu.allocate(3 + unhashed)
    entries = [(key(0, 1), 4), (key(1, 1), state_block_size), (key(2, 0), 4)]
    for block_id, (block_key, num_tokens) in zip(blocks, entries, strict=False):
        gpu.insert_key(block_key, block_id, min(num_tokens, state_block_size))
    gpu.free(blocks)
    return StoreSelector(
        layout(state_block_size),
        gpu,
        BlockPool(num_tier_blocks + 1),
        StepCounters(),
        record_payload=False,
        fine_grained=False,
    )


def test_only_a_coarse_state_group_counts() -> None:
    assert layout(8).coarse_state_groups == {1: 8}
    assert layout(4).coarse_state_groups == {}


def test_the_lazy_walk_skips_a_state_keyed_inside_its_block() -> None:
    chosen = selector(8)
    partial, whole, full_tail = chosen.gpu_pool.iter_free_after(None)
    chosen.select_lazy(8)
    assert chosen.take_queued().gpu_block_ids == [whole, full_tail]
    assert chosen.counters.store_outcomes == {"stored": 2, "dropped_partial_state": 1}
    assert chosen.lazy.cursor == partial  # the last visited block still free


def test_a_state_group_of_the_hash_block_size_keeps_every_state() -> None:
    chosen = selector(4)  # every key ends its block: none is partial
    chosen.select_lazy(8)
    assert len(chosen.take_queued().gpu_block_ids) == 3
    assert "dropped_partial_state" not in chosen.counters.store_outcomes


def test_a_walk_a_full_tier_stops_resumes_after_the_blocks_it_passed() -> None:
    chosen = selector(8, num_tier_blocks=1)
    partial, whole, full_tail = chosen.gpu_pool.iter_free_after(None)
    chosen.select_lazy(8)
    assert chosen.take_queued().gpu_block_ids == [whole]
    assert chosen.lazy.deferred == {full_tail}
    assert chosen.lazy.cursor == partial  # the next walk starts at the block it stopped at


@pytest.mark.parametrize(
    ("state_block_size", "outcome"), [(8, "dropped_partial_state"), (4, "stored")]
)
def test_a_hand_off_of_a_state_keyed_inside_its_block_is_dropped(
    state_block_size: int, outcome: str
) -> None:
    chosen = selector(state_block_size)
    partial = next(iter(chosen.gpu_pool.iter_free_after(None)))
    chosen.select_handoffs([Handoff("r", 1, partial)], frozenset(), require_tracked=False)
    assert chosen.counters.handoff_outcomes == {outcome: 1}


def test_a_state_block_with_no_token_count_recorded_is_whole() -> None:
    """A pool that records no token count for a key (0) keeps a state block whole, as
    before counts were recorded (a mutant took it for a partial state: never stored)."""
    gpu = BlockPool(4)
    (block,) = gpu.allocate(1)
    gpu.insert_key(key(1, 1), block, 0)
    assert not is_partial_state(layout(8), gpu, block)
    gpu.insert_key(key(3, 1), gpu.allocate(1)[0], 4)  # a count inside the block
    assert is_partial_state(layout(8), gpu, block + 1)


def test_an_unhashed_block_the_walk_passes_is_no_partial_state() -> None:
    """An unhashed free block heads the walk (reused first): it is skipped as unhashed,
    not counted a dropped partial state (a mutant filtered it out with the partial
    states: dropped_partial_state 2)."""
    chosen = selector(8, unhashed=1)
    _, _, whole, full_tail = chosen.gpu_pool.iter_free_after(None)
    chosen.select_lazy(8)
    assert chosen.take_queued().gpu_block_ids == [whole, full_tail]
    assert chosen.counters.store_outcomes["dropped_partial_state"] == 1


def test_a_hand_off_of_an_unhashed_state_block_is_dropped_as_unhashed() -> None:
    """A hand-off of a state block with no key, beside a coarse state group: dropped
    unhashed (a mutant read the group of its missing key: TypeError)."""
    chosen = selector(8, unhashed=1)
    unhashed = next(iter(chosen.gpu_pool.iter_free_after(None)))
    chosen.select_handoffs([Handoff("r", 1, unhashed)], frozenset(), require_tracked=False)
    assert chosen.counters.handoff_outcomes == {"dropped_unhashed": 1}


def test_a_walk_a_full_tier_stops_past_a_partial_state_resumes_where_it_stopped() -> None:
    """Free blocks: a partial state, a block already in the tier, a partial tail. The
    tier has no free slot: the walk drops the partial state, skips the cached block and
    stops at the tail. Its cursor is the cached block (the last it passed, counted in
    the walk's run without the partial state): the next walk counts nothing again."""
    gpu = BlockPool(4)
    partial, cached, tail = gpu.allocate(3)
    gpu.insert_key(key(0, 1), partial, 4)
    gpu.insert_key(key(5, 0), cached, 8)
    gpu.insert_key(key(2, 0), tail, 4)
    gpu.free([partial, cached, tail])
    tier = BlockPool(2)
    (slot,) = tier.allocate(1)  # the tier's one slot, pinned: no room
    tier.insert_key(key(5, 0), slot, 8)
    chosen = StoreSelector(
        layout(8), gpu, tier, StepCounters(), record_payload=False, fine_grained=False
    )
    chosen.select_lazy(8)
    assert chosen.lazy.cursor == cached
    chosen.select_lazy(8)
    assert not chosen.queued
    assert chosen.counters.store_outcomes == {
        "dropped_partial_state": 1,
        "skipped_already_cached": 1,
        "deferred_tier_full": 1,
    }
