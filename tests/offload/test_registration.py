"""Registration of completed stores: the batched `register_all` equals `register` per item."""

from __future__ import annotations

import hashlib

import pytest
from sim_request import full_layout

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, key_block_hash, make_key
from kvtier.offload.plan import SlotRecord, Tier
from kvtier.offload.registration import Registrar
from kvtier.offload.store_batch import StoreBatch


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"reg%d" % i).digest(), 0)


def gpu_pool_and_items() -> tuple[BlockPool, StoreBatch]:
    """Return a GPU pool and stores covering every registration case.

    Block 1: a plain cached block. Block 2: a cached block with a secondary key. Block 3:
    a block that lost its key while pinned (the item's key and the group's block size
    are used). Block 4: a block whose item registers a 3-token partial tail.
    """
    gpu = BlockPool(8)
    gpu.allocate(4)
    gpu.insert_key(key(1), 1, 4)
    gpu.insert_key(key(2), 2, 4)
    gpu.insert_key(key(20), 2, 4)  # secondary
    gpu.insert_key(key(4), 4, 4)
    stores = StoreBatch()
    stores.extend([1, 2, 3], [1, 2, 3], [key(1), key(2), key(3)])
    stores.add(4, 4, key(40), tail_num_tokens=3)
    return gpu, stores


def tier_state(pool: BlockPool) -> list[tuple[Key | None, int, tuple[Key, ...]]]:
    return [
        (pool.key(b), pool.num_tokens(b), tuple(pool.secondary_keys(b)))
        for b in range(1, pool.num_blocks)
    ]


@pytest.mark.parametrize("events", [False, True])
def test_register_all_equals_register_per_item(events: bool) -> None:
    layout = full_layout(block_size=4)
    tiers = []
    for batched in (False, True):
        gpu, stores = gpu_pool_and_items()
        tier = BlockPool(8, record_events=events, medium="CPU")
        tier.allocate(4)
        registrar = Registrar(layout, Tier.CPU, tier, events=events)
        if batched:
            registrar.register_all(stores, gpu)
        else:
            for index in range(len(stores)):
                registrar.register(stores, index, gpu)
        tier.check_invariants()
        tiers.append(tier)
    per_item, batch = tiers
    assert tier_state(batch) == tier_state(per_item)
    assert tier_state(batch)[:4] == [
        (key(1), 4, ()),
        (key(2), 4, (key(20),)),
        (key(3), 4, ()),
        (key(40), 3, ()),
    ]
    assert batch.take_events() == per_item.take_events()


def test_restore_counts_the_tokens_inside_each_block() -> None:
    """Manifests written before the vLLM adapter counted a block's own tokens hold vLLM's
    prefix counts (block 3 of 4-token blocks: 12); restored, each slot counts its own."""
    tier = BlockPool(8, record_events=True, medium="DISK")
    registrar = Registrar(full_layout(block_size=4), Tier.DISK, tier, events=True)
    records = [(1, SlotRecord(key(1), 4)), (2, SlotRecord(key(2), 12)), (3, SlotRecord(key(3), 3))]
    assert registrar.restore(Tier.DISK, tier, records) == 3
    assert [tier.num_tokens(b) for b in (1, 2, 3)] == [4, 4, 3]
    assert [e.block_size for e in tier.take_events()] == [4, 4, 3]


def test_a_payload_is_published_only_for_the_key_it_was_captured_for() -> None:
    """A selection-time payload reaches the tier's event only if its hash is the key's.

    Block 1 keeps the key its payload names: the event carries the payload's token ids,
    with the tier's medium. Block 2's payload names another hash (a stale capture): its
    event is payload-free, built from the key the GPU block holds at completion.
    """
    layout = full_layout(block_size=4)
    gpu = BlockPool(8)
    gpu.allocate(2)
    gpu.insert_key(key(1), 1, 4)
    gpu.insert_key(key(2), 2, 4)
    tier = BlockPool(8, record_events=True, medium="CPU")
    tier.allocate(2)
    captured = BlockStored(key_block_hash(key(1)), 0, 4, token_ids=(5, 6, 7, 8), medium="GPU")
    stale = BlockStored(key_block_hash(key(99)), 0, 4, token_ids=(9, 9, 9, 9), medium="GPU")
    stores = StoreBatch()
    stores.add(1, 1, key(1), payload=captured)
    stores.add(2, 2, key(2), payload=stale)
    Registrar(layout, Tier.CPU, tier, events=True).register_all(stores, gpu)
    events = [e for e in tier.take_events() if isinstance(e, BlockStored)]
    assert [(e.block_hash, e.token_ids, e.medium) for e in events] == [
        (key_block_hash(key(1)), (5, 6, 7, 8), "CPU"),
        (key_block_hash(key(2)), (), "CPU"),
    ]
