"""Lazy store selection's bookkeeping of copied GPU blocks (SPEC §6.6)."""

from __future__ import annotations

import hashlib

from sim_request import full_layout

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.offload.stats import StepCounters
from kvtier.offload.store_selection import StoreSelector


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"lazy%d" % i).digest(), 0)


def lazy_selector(num_cached: int) -> StoreSelector:
    """Return a selector over a GPU pool whose `num_cached` free blocks hold keys."""
    gpu = BlockPool(8)
    blocks = gpu.allocate(num_cached)
    for i, block_id in enumerate(blocks):
        gpu.insert_key(key(i), block_id, 4)
    gpu.free(blocks[::-1])
    return StoreSelector(
        full_layout(block_size=4),
        gpu,
        BlockPool(8),
        StepCounters(),
        record_payload=False,
        fine_grained=False,
    )


def test_completed_lazy_copies_are_remembered_with_their_keys() -> None:
    """A copied block is skipped later (until a request uses it) by its block -> key entry."""
    selector = lazy_selector(2)
    selector.select_lazy(8)
    items = selector.take_queued()
    assert selector.lazy_copying == {item.gpu_block_id for item in items}
    selector.note_lazy_stores(items)
    assert selector.lazy_stored == {item.gpu_block_id: item.key for item in items}
    assert not selector.lazy_copying


def test_a_block_used_while_its_copy_is_in_flight_is_not_remembered() -> None:
    """A request hitting a block mid-copy makes it a fresh candidate once freed again."""
    selector = lazy_selector(2)
    selector.select_lazy(8)
    used, other = selector.take_queued()
    selector.note_blocks_in_use([[used.gpu_block_id]])
    selector.note_lazy_stores([used, other])
    assert selector.lazy_stored == {other.gpu_block_id: other.key}
    assert not selector.lazy_copying


def test_released_lazy_copies_are_forgotten() -> None:
    """A failed or abandoned copy releases its pins and leaves nothing tracked."""
    selector = lazy_selector(2)
    selector.select_lazy(8)
    selector.release(selector.take_queued())
    assert not selector.lazy_copying
    assert not selector.lazy_stored
