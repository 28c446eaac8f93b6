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
