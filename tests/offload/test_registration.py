"""Registration of completed stores: the batched `register_all` equals `register` per item."""

from __future__ import annotations

import hashlib

import pytest
from sim import SimEngine, make_request
from sim_request import full_layout

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, key_block_hash, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import SlotRecord, Tier
from kvtier.offload.registration import Registrar
from kvtier.offload.store_batch import StoreBatch

SCRATCH = GroupKind.SCRATCH


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"reg%d" % i).digest(), 0)


def gpu_pool_and_items() -> tuple[BlockPool, StoreBatch]:
    """Return a GPU pool and stores covering every registration case.

    Block 1: a plain cached block. Block 2: a cached block with a secondary key. Block 3:
    a block that lost its key while pinned (the item's key and the group's block size
    are used). Block 4: a block whose item registers a 3-token partial tail (the block's
    own keys, a secondary one too, are not the tail's).
    """
    gpu = BlockPool(8)
    gpu.allocate(4)
    gpu.insert_key(key(1), 1, 4)
    gpu.insert_key(key(2), 2, 4)
    gpu.insert_key(key(20), 2, 4)  # secondary
    gpu.insert_key(key(4), 4, 4)
    gpu.insert_key(key(41), 4, 4)  # secondary
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
    # A partial key's event spans its last hash block (here 4 tokens), as vLLM's does.
    assert [e.block_size for e in tier.take_events()] == [4, 4, 4]


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


def restoring_registrar() -> tuple[BlockPool, Registrar]:
    layout = KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64), KVGroupSpec(SCRATCH, 4, 64)))
    tier = BlockPool(8, medium="DISK")
    return tier, Registrar(layout, Tier.DISK, tier, events=False)


def test_restore_skips_slots_already_indexed_and_keys_of_groups_never_cached() -> None:
    """A slot named twice keeps its first record; a key of a scratch group (never stored)
    is not indexed. Each skip is a warning, not an error."""
    tier, registrar = restoring_registrar()
    scratch_key = make_key(hashlib.sha256(b"scratch").digest(), 1)
    records = [
        (1, SlotRecord(key(1), 4)),
        (1, SlotRecord(key(2), 4)),
        (2, SlotRecord(scratch_key, 4)),
    ]
    assert registrar.restore(Tier.DISK, tier, records) == 1
    assert tier.cached_block(key(1)) == 1
    assert tier.cached_block(key(2)) is None
    assert tier.cached_block(scratch_key) is None
    assert registrar.restore(Tier.DISK, tier, [(1, SlotRecord(key(3), 4))]) == 0
    assert tier.key(1) == key(1)
    tier.check_invariants()


def test_restored_slots_are_cached_and_evictable() -> None:
    """Restored slots are cached blocks nobody uses: the tier can evict them for new stores."""
    tier, registrar = restoring_registrar()
    records = [(slot, SlotRecord(key(slot), 4)) for slot in range(1, 8)]
    assert registrar.restore(Tier.DISK, tier, records) == 7
    assert tier.num_free() == tier.num_usable_blocks == 7
    assert all(tier.ref_count(slot) == 0 for slot in range(1, 8))
    tier.allocate(7)  # evicts every restored slot
    assert all(tier.cached_block(key(slot)) is None for slot in range(1, 8))


def test_a_stored_partial_tails_slot_record_counts_its_own_tokens() -> None:
    """The slot record of a fine-grained partial tail (SPEC §6.7) counts the tail's tokens,
    not the GPU block's: a restart restores the tail as a partial block."""
    config = OffloadConfig(
        disk_bytes=1 << 20, disk_path="unused", disk_persist=True, fine_grained_hits=True
    )
    engine = SimEngine(full_layout(block_size=8, hash_block_size=4), config)
    engine.run(make_request("a", range(12)))  # block 0 whole, block 1 a 4-token tail
    engine.drain()
    records = [r for job in engine.worker.stores() for r in job.dst_records]
    assert sorted(r.num_tokens for r in records) == [4, 8]
