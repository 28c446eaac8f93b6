"""What `StoreQueueing` does around a selected store (`offload/store_queueing.py`): a
store released unregistered gives its GPU blocks back tail first, and a tagged store
replacing untagged copies of its key leaves a block holding the key as a secondary key
its own primary key. Also the checks `try_select` makes before it pins anything, and
when `replace_untagged` drops nothing (SPEC §3 Beyond, the token check)."""

from __future__ import annotations

import pytest
from sim import SimEngine, full_layout, make_request
from sim_request import config, store_selector
from test_cascade_demotions import key

from kvtier.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.request_tags import RequestTags
from kvtier.offload.stats import StoreOutcome
from kvtier.offload.store_selection import StoreSelector

TAG = b"t" * 16


def keyed_gpu_block(gpu: BlockPool, key_id: int) -> int:
    """Return a GPU block allocated and cached under `key(key_id)` (4 tokens)."""
    (block,) = gpu.allocate(1)
    gpu.insert_key(key(key_id), block, 4)
    return block


def checking(selector: StoreSelector, replacing: bool) -> StoreSelector:
    """Turn the token check on (`replacing`: over a disk-only tier, as the scheduler)."""
    selector.tags = RequestTags(selector.layout)
    selector.replaced = DroppedSlots(active=True) if replacing else None
    return selector


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


def test_the_null_block_is_never_queued_even_under_a_tail_key() -> None:
    """The null GPU block holds no KV: named with a partial tail's key it is still the
    `NULL` outcome, with no tier slot taken (a mutant copied it under that key)."""
    tier = BlockPool(4)
    selector = store_selector(BlockPool(4), tier)
    outcome = selector.try_select(NULL_BLOCK_ID, tail_key=key(1), tail_num_tokens=2)
    assert outcome is StoreOutcome.NULL
    assert len(selector.queued) == 0
    assert tier.num_free() == 3


def test_a_tag_computed_for_another_key_is_not_the_blocks() -> None:
    """`tag` names the key it was computed for: for a block holding another key it is
    not recorded, and with the check on, a store with no tag is never made (a mutant
    stored the block under its own key with the other key's tag)."""
    gpu, tier = BlockPool(4), BlockPool(4)
    selector = checking(store_selector(gpu, tier), replacing=False)
    block = keyed_gpu_block(gpu, 1)
    assert selector.try_select(block, tag=(key(2), TAG)) is StoreOutcome.NO_TAG
    assert len(selector.queued) == 0
    assert selector.try_select(block, tag=(key(1), TAG)) is StoreOutcome.STORED
    assert selector.queued.tags == {0: TAG}


def test_an_untagged_store_replaces_no_untagged_copy() -> None:
    """With the check on a disk-only tier, only a tagged store replaces an untagged
    copy of its key: one with no tag (a block the GPU cache shared, filler unknown)
    skips it as cached, and the copy stays (a mutant dropped it, then stored nothing)."""
    gpu, tier = BlockPool(4), BlockPool(4)
    selector = checking(store_selector(gpu, tier), replacing=True)
    tier.touch([2])
    tier.insert_key(key(5), 2, 4)  # restored from a run without the check
    tier.free([2])
    block = keyed_gpu_block(gpu, 5)
    assert selector.try_select(block) is StoreOutcome.ALREADY_CACHED
    assert tier.key(2) == key(5)
    assert selector.replaced is not None
    assert selector.replaced.take() == ()


@pytest.mark.parametrize("other", ["tagged", "pinned"])
def test_a_tagged_or_pinned_copy_keeps_every_copy_of_its_key(other: str) -> None:
    """Tier block 2 holds an untagged copy of key 5; block 1 another copy, tagged (a
    hash collision's, served) or untagged but pinned (read by a transfer). Nothing is
    replaced: both keep key 5 (a mutant dropped them when not all copies were tagged or
    pinned, or took no account of pins)."""
    gpu, tier = BlockPool(4), BlockPool(4)
    selector = checking(store_selector(gpu, tier), replacing=True)
    tier.touch([1, 2])
    tier.insert_key(key(5), 1, 4, tag=TAG if other == "tagged" else None)
    tier.insert_key(key(5), 2, 4)
    tier.free([2] if other == "pinned" else [2, 1])
    assert not selector.replace_untagged(key(5))
    assert (tier.key(1), tier.key(2)) == (key(5), key(5))
    assert selector.replaced is not None
    assert selector.replaced.take() == ()
    tier.check_invariants()


def test_no_copy_is_replaced_without_a_disk_only_tier() -> None:
    """With no `replaced` (a CPU tier, whose copies are all tagged with the check on), a
    key held only as a secondary key of a tier block stays there: replacing is for a
    disk-only tier's restored copies (a mutant dropped the key, then failed)."""
    gpu, tier = BlockPool(4), BlockPool(4)
    selector = checking(store_selector(gpu, tier), replacing=False)
    tier.touch([1])
    tier.insert_key(key(1), 1, 4, tag=TAG)
    tier.insert_key(key(5), 1, 4)  # secondary
    tier.free([1])
    assert not selector.replace_untagged(key(5))
    assert tier.secondary_keys(1) == (key(5),)
    block = keyed_gpu_block(gpu, 5)
    assert selector.try_select(block, tag=(key(5), TAG)) is StoreOutcome.ALREADY_CACHED
