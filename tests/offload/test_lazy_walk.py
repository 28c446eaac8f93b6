"""Lazy mode's memory of GPU blocks between walks (`LazyWalk`, `held_hits`; SPEC §6.6).

A held-back block holds KV never computed (a failed forward's, a same-step victim's):
it stays out of the tier while it keeps the key it was held under and no request
writes it. A block a request writes, or one the engine gives afresh (losing its key),
is a fresh candidate once freed again.
"""

from __future__ import annotations

import hashlib

from sim_request import full_layout, make_request, store_selector

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.offload.lazy_walk import LazyWalk, held_hits
from kvtier.offload.protocols import LoRAInfo, ScheduledRequest, TableUpdate


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"walk%d" % i).digest(), 0)


def keyed_pool(num_blocks: int) -> tuple[BlockPool, list[int]]:
    """Return a GPU pool whose blocks 1..num_blocks hold keys 0, 1, ..., all free."""
    gpu = BlockPool(num_blocks + 1)
    blocks = gpu.allocate(num_blocks)
    for i, block_id in enumerate(blocks):
        gpu.insert_key(key(i), block_id, 4)
    gpu.free(blocks)
    return gpu, blocks


def test_a_held_block_the_engine_allocates_afresh_is_no_longer_held() -> None:
    """`note_allocated`: a held block given as a prefix hit (its key kept) stays held; one
    allocated afresh lost its key, the request writes it, and it is a candidate again."""
    gpu, (fresh, hit) = keyed_pool(2)
    walk = LazyWalk()
    walk.hold_back([fresh, hit], [key(0), key(1)])
    assert gpu.allocate(1) == [fresh]  # the head of the free queue: its key goes
    gpu.touch([hit])  # a prefix hit on the other
    walk.note_allocated([[hit, fresh]], gpu)
    assert walk.held == {hit: key(1)}
    assert walk.stored == {hit: key(1)}


def test_an_allocated_request_s_adapter_is_noted_for_its_blocks() -> None:
    """`note_allocated` with the request (events on): the walk's later store of a block
    the request took names its adapter, not the adapter of the block's earlier user."""
    gpu, (block,) = keyed_pool(1)
    walk = LazyWalk(record_loras=True)
    walk.loras[block] = LoRAInfo(1, "earlier")
    request = make_request("r", range(4), lora=LoRAInfo(7, "sql"))
    gpu.touch([block])
    walk.note_allocated([[block]], gpu, request)
    assert walk.loras == {block: LoRAInfo(7, "sql")}


def scheduled(
    block_ids: list[int], computed: int, update: TableUpdate = TableUpdate.REPLACE
) -> ScheduledRequest:
    request = make_request("r", range(16))
    request.num_computed_tokens = computed
    return ScheduledRequest(request, (block_ids,), 4, update)


def test_held_hits_are_the_held_blocks_a_new_table_reads_under_their_held_keys() -> None:
    """A hit reads a held block and writes nothing: only a replaced table's positions
    before its computed tokens count, and only while the block keeps its held key. A
    position the step computes, an appended block and a block keyed otherwise since
    are written (or hold other KV): not hits, so no longer held once noted in use."""
    gpu, (a, b, c, d) = keyed_pool(4)
    held = {a: key(0), b: key(1), c: key(99), d: key(3)}  # c holds key 2 now
    layout = full_layout(block_size=4)
    new_table = scheduled([a, c, b], computed=8)  # a and c read, b written this step
    appended = scheduled([d], computed=8, update=TableUpdate.APPEND)
    assert held_hits(layout, held, gpu, [new_table, appended]) == {a: key(0)}


def test_a_reset_counts_a_block_still_waiting_for_a_slot_as_deferred_again() -> None:
    """A block the walk stops at for want of a tier slot counts as deferred once however
    many walks it waits; a reset forgets that, as everything else the walk noted but the
    held-back blocks (`LazyWalk.clear`)."""
    gpu, _ = keyed_pool(2)
    selector = store_selector(gpu, BlockPool(2))  # one tier slot
    for _ in range(2):
        selector.select_lazy(8)  # stores block 1, stops at block 2
    assert selector.counters.store_outcomes == {"stored": 1, "deferred_tier_full": 1}
    selector.lazy.clear()
    selector.select_lazy(8)
    assert selector.counters.store_outcomes == {"stored": 1, "deferred_tier_full": 2}


def test_a_block_selected_then_released_counts_as_deferred_again() -> None:
    """A deferred block counts once while it waits, until selected: its copy failed (the
    store released), it waits for a slot anew and counts again."""
    gpu, (block,) = keyed_pool(1)
    tier = BlockPool(2)  # one slot
    selector = store_selector(gpu, tier)
    pinned = tier.allocate(1)
    selector.select_lazy(8)  # no room: deferred
    tier.free(pinned)
    selector.select_lazy(8)  # selected
    assert selector.queued.gpu_block_ids == [block]
    selector.release(selector.take_queued(), failed=True)
    tier.allocate(1)
    selector.select_lazy(8)  # no room again
    assert selector.counters.store_outcomes == {"stored": 1, "deferred_tier_full": 2}
