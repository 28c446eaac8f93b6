"""What `StoreQueueing` does around a selected store (`offload/store_queueing.py`): a
store released unregistered gives its GPU blocks back tail first, and a tagged store
replacing untagged copies of its key leaves a block holding the key as a secondary key
its own primary key."""

from __future__ import annotations

from sim import SimEngine, full_layout, make_request
from sim_request import config, store_selector
from test_cascade_demotions import key

from kvtier.core.block_pool import BlockPool
from kvtier.offload.dropped_slots import DroppedSlots


def test_a_failed_stores_gpu_blocks_go_back_tail_first() -> None:
    """A request's 3 blocks, stored in position order; the store fails. Released, its
    GPU blocks join the free queue as every release does, last position first, so the
    prefix tail is evicted before its root (a mutant released root first)."""
    engine = SimEngine(full_layout(), config(), num_gpu_blocks=8)
    store = engine.store_of_finished(make_request("a", range(13)))
    table = list(store.src_block_ids)
    assert len(table) == 3
    engine.worker.fail(store.event_id)
    engine.poll()
    order = [b for b in engine.gpu.iter_free_after(None) if b in table]
    assert order == table[::-1]
    engine.check()


def test_replacing_untagged_copies_leaves_a_secondary_holders_own_key() -> None:
    """Tier block 1 holds its own key, tagged, and key 5 as a secondary key; block 2 an
    untagged copy of key 5. A tagged store of key 5 drops block 2's keys and only key 5
    from block 1 (a mutant dropped every key of block 1: its served copy lost too)."""
    tier = BlockPool(4)
    selector = store_selector(BlockPool(4), tier)
    selector.replaced = DroppedSlots(active=True)
    tier.touch([1, 2])
    tier.insert_key(key(1), 1, 4, tag=b"t" * 16)
    tier.insert_key(key(5), 1, 4)  # secondary
    tier.insert_key(key(5), 2, 4)  # primary, untagged
    tier.free([2, 1])
    assert selector.replace_untagged(key(5))
    assert tier.key(1) == key(1)
    assert tier.secondary_keys(1) == ()
    assert tier.key(2) is None
    assert selector.replaced.take() == (2,)
    tier.check_invariants()
