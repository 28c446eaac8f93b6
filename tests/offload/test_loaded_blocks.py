"""`LoadedBlocks`: the GPU blocks a landed load filled, from the landing until the
block's first completed store (see the module), which then skips the refresh of its disk
copy (`tests/offload/test_cascade_promotion_uses.py`, the scheduler-level behaviour)."""

from __future__ import annotations

import hashlib

from sim import make_request
from test_cascade_promotion_uses import A_KEYS, _evict_from_cpu
from test_scenarios_cascade import cascade_engine

from kvtier.core.keys import Key, make_key
from kvtier.offload.config import CascadeMode
from kvtier.offload.loaded_blocks import LoadedBlocks
from kvtier.offload.store_batch import StoreBatch


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"loaded%d" % i).digest(), 0)


def stores_of(*blocks: tuple[int, Key]) -> StoreBatch:
    """Return completed stores of GPU block -> key (tier slots 100, 101, ...)."""
    stores = StoreBatch()
    for i, (gpu_block, block_key) in enumerate(blocks):
        stores.add(gpu_block, 100 + i, block_key)
    return stores


def test_the_first_store_of_a_loaded_block_consumes_its_entry() -> None:
    """Only the block's first completed store is the loader's use: a later store of the
    same block under the same key (the CPU copy evicted and stored again) refreshes its
    disk copy as any store does."""
    loaded = LoadedBlocks()
    loaded.note_loaded("b", [3, 4], [key(3), key(4)])
    assert loaded.take_stores(stores_of((4, key(4)), (9, key(9)))) == {0}
    assert loaded.by_block == {3: ("b", key(3))}
    assert loaded.take_stores(stores_of((4, key(4)))) == set()


def test_a_store_under_another_key_only_drops_the_entry() -> None:
    """The block holds other KV than the load copied: its store is no loader's use."""
    loaded = LoadedBlocks()
    loaded.note_loaded("b", [3], [key(3)])
    assert loaded.take_stores(stores_of((3, key(30)))) == set()
    assert loaded.by_block == {}


def test_another_request_using_a_block_of_any_group_drops_its_entry() -> None:
    """A hybrid layout: blocks of the second group are used by another request too;
    the loader's own use of its blocks keeps their entries."""
    loaded = LoadedBlocks()
    loaded.note_loaded("b", [3, 4, 7, 8], [key(3), key(4), key(7), key(8)])
    loaded.note_in_use("b", ([3, 4], [7]))
    loaded.note_in_use("c", ([5], [8]))
    assert loaded.by_block == {3: ("b", key(3)), 4: ("b", key(4)), 7: ("b", key(7))}


def test_a_reset_forgets_the_blocks_loads_filled() -> None:
    """SPEC §6.9: a reset drops what the tiers served; b's load from disk landed and b
    stored nothing (its compute failed), so its entries were still kept."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, 4, 12)
    engine.run(make_request("a", range(12)))
    engine.drain()
    _evict_from_cpu(engine, 100)
    b = make_request("b", [*range(12), 7])
    assert engine.admit(b) is not None
    while "b" in engine.loading:
        engine.step()
    selector = engine.scheduler.selector
    assert len(selector.loaded.by_block) == len(A_KEYS)
    engine.finish("b", computed=False)
    engine.drain()
    assert engine.scheduler.reset()
    assert selector.loaded.by_block == {}
    engine.check()
