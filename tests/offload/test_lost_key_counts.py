"""A store whose GPU block lost its keys before the copy completed registers under the
key selected (`Registrar.register`): with the count that key had in its block. In a
layout whose blocks (8 tokens) span several hash blocks (4), the key selected may be a
partial entry covering the block's first hash block only: the tier's count, its event's
block size and a disk manifest's record describe those 4 tokens, not a whole block."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.plan import Tier
from kvtier.offload.registration import Registrar
from kvtier.offload.stats import StepCounters
from kvtier.offload.store_selection import StoreSelector

LAYOUT = KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, 8, 64),), configured_hash_block_size=4)


@pytest.mark.parametrize("events", [False, True], ids=["", "events"])
@pytest.mark.parametrize("lazy", [False, True], ids=["one", "walk"])
@pytest.mark.parametrize("num_tokens", [4, 8], ids=["partial", "whole"])
def test_a_store_whose_block_lost_its_key_registers_the_count_selected(
    events: bool, lazy: bool, num_tokens: int
) -> None:
    gpu = BlockPool(4)
    (block,) = gpu.allocate(1)
    key = make_key(hashlib.sha256(b"first hash block").digest(), 0)
    gpu.insert_key(key, block, num_tokens)
    tier = BlockPool(4, record_events=events, medium=Tier.CPU.value)
    selector = StoreSelector(
        LAYOUT, gpu, tier, StepCounters(), record_payload=False, fine_grained=True
    )
    if lazy:
        gpu.free([block])
        selector.select_lazy(4)  # the walk's batched run
    else:
        selector.try_select(block)
    stores = selector.take_queued()
    assert stores.keys == [key]
    gpu.discard_keys(block)  # e.g. held back as unconfirmed compute
    registrar = Registrar(LAYOUT, Tier.CPU, tier, events=events)
    (record,) = registrar.records(stores, gpu)
    assert (record.key, record.num_tokens) == (key, num_tokens)
    registrar.register_all(stores, gpu)
    (tier_block,) = stores.tier_block_ids
    assert tier.cached_block(key) == tier_block
    assert tier.num_tokens(tier_block) == num_tokens
    if events:
        (event,) = tier.take_events()
        assert event.block_size == num_tokens


def test_each_store_keeps_its_own_count_when_several_are_queued() -> None:
    """Two stores selected one by one: a whole block (8 tokens), then a partial entry
    (4). Both blocks lose their keys before the copies complete: each registers its own
    count (a mutant noted the second store's count at index 0: the whole block
    registered 4 tokens, the partial entry 8, half of them never computed under it)."""
    gpu = BlockPool(4)
    whole, partial = gpu.allocate(2)
    keys = [make_key(hashlib.sha256(name).digest(), 0) for name in (b"whole", b"partial")]
    gpu.insert_key(keys[0], whole, 8)
    gpu.insert_key(keys[1], partial, 4)
    tier = BlockPool(4, medium=Tier.CPU.value)
    selector = StoreSelector(
        LAYOUT, gpu, tier, StepCounters(), record_payload=False, fine_grained=True
    )
    selector.try_select(whole)
    selector.try_select(partial)
    stores = selector.take_queued()
    gpu.discard_keys(whole)
    gpu.discard_keys(partial)
    registrar = Registrar(LAYOUT, Tier.CPU, tier, events=False)
    records = registrar.records(stores, gpu)
    assert [(r.key, r.num_tokens) for r in records] == [(keys[0], 8), (keys[1], 4)]
    registrar.register_all(stores, gpu)
    assert [tier.num_tokens(b) for b in stores.tier_block_ids] == [8, 4]


def test_a_walk_over_keyed_blocks_only_notes_a_partial_entry_s_count() -> None:
    """The walk's run of keyed blocks only is taken whole (`take_whole_run`), as the
    common steady state: a partial entry's count (4 of 8 tokens) is noted as the
    per-block loop notes it, and registered once its block lost its keys."""
    gpu = BlockPool(2)  # one block besides the null one: the free queue is keyed only
    (block,) = gpu.allocate(1)
    key = make_key(hashlib.sha256(b"first hash block").digest(), 0)
    gpu.insert_key(key, block, 4)
    gpu.free([block])
    tier = BlockPool(4, medium=Tier.CPU.value)
    selector = StoreSelector(
        LAYOUT, gpu, tier, StepCounters(), record_payload=False, fine_grained=True
    )
    selector.select_lazy(4)
    stores = selector.take_queued()
    assert (stores.keys, stores.counts) == ([key], {0: 4})
    gpu.discard_keys(block)
    Registrar(LAYOUT, Tier.CPU, tier, events=False).register_all(stores, gpu)
    assert tier.num_tokens(tier.cached_block(key)) == 4
