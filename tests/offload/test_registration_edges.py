"""Registration edges (`offload/registration.py`): tags and payloads of partial tails,
tags in the rare per-item path, a keyed GPU block with no recorded count, partial
entries' events, slot records, and what `restore` skips or drops (SPEC §3 Beyond, the
token check; SPEC §6.7 fine-grained tails)."""

from __future__ import annotations

from collections.abc import Sequence

from sim_request import full_layout
from test_registration import gpu_pool_and_items, key

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import key_block_hash
from kvtier.offload.plan import SlotRecord, Tier
from kvtier.offload.registration import Registrar
from kvtier.offload.store_batch import StoreBatch

TAG, OTHER = b"t" * 16, b"o" * 16


def registered_tier(stores: StoreBatch, gpu: BlockPool, events: bool) -> BlockPool:
    tier = BlockPool(8, record_events=events, medium="CPU")
    tier.allocate(len(stores))
    Registrar(full_layout(block_size=4), Tier.CPU, tier, events=events).register_all(stores, gpu)
    return tier


def test_a_tagged_partial_tail_keeps_its_tag_and_its_captured_payload() -> None:
    """Events on: a fine-grained tail registers under its own key with the tag of its
    KV and the payload captured at selection (mutants dropped the tag: the check never
    served the tail; or published a payload-free event)."""
    gpu = BlockPool(8)
    gpu.allocate(1)
    payload = BlockStored(key_block_hash(key(40)), 0, 4, token_ids=(1, 2, 3), medium="GPU")
    stores = StoreBatch()
    stores.add(1, 1, key(40), tail_num_tokens=3, payload=payload, tag=TAG)
    tier = registered_tier(stores, gpu, events=True)
    assert (tier.key(1), tier.num_tokens(1), tier.tag(1)) == (key(40), 3, TAG)
    (event,) = [e for e in tier.take_events() if isinstance(e, BlockStored)]
    assert (event.token_ids, event.medium) == ((1, 2, 3), "CPU")


def test_a_batch_with_a_block_keyed_further_keeps_the_others_tags() -> None:
    """Events off: one GPU block was keyed further since its selection (its slot goes
    back unkeyed), so the batch registers item by item; the other block keeps its tag
    (a mutant dropped tags on that path: a miss for every later request)."""
    gpu = BlockPool(8)
    gpu.allocate(2)
    gpu.insert_key(key(1), 1, 4)
    gpu.insert_key(key(99), 2, 4)  # selected under key 2, keyed otherwise since
    stores = StoreBatch()
    stores.add(1, 1, key(1), tag=TAG)
    stores.add(2, 2, key(2), tag=OTHER)
    tier = registered_tier(stores, gpu, events=False)
    assert (tier.key(1), tier.tag(1)) == (key(1), TAG)
    assert tier.key(2) is None


class UncountedGpu(BlockPool):
    """A GPU pool view whose keyed blocks have no recorded count (vLLM's view: 0)."""

    def num_tokens(self, block_id: int) -> int:
        return 0

    def token_counts(self, block_ids: Sequence[int]) -> list[int]:
        return [0 for _ in block_ids]


def test_a_keyed_gpu_block_with_no_recorded_count_registers_its_selected_count() -> None:
    """A GPU block that kept its key but whose view records no count registers the
    count noted at selection, else its group's block size (a mutant took the batched
    path: a 0-token insert, refused by the tier pool)."""
    gpu = UncountedGpu(8)
    gpu.allocate(2)
    gpu.insert_key(key(1), 1, 4)
    gpu.insert_key(key(2), 2, 4)
    stores = StoreBatch()
    stores.extend([1, 2], [1, 2], [key(1), key(2)])
    stores.counts[1] = 3
    tier = registered_tier(stores, gpu, events=False)
    assert [(tier.key(b), tier.num_tokens(b)) for b in (1, 2)] == [(key(1), 4), (key(2), 3)]


def test_a_partial_entry_s_event_spans_one_hash_block_without_extra_keys() -> None:
    """A secondary key and a key covering less than its block are partial entries: their
    events have the hash block size and unknown extra keys, as vLLM's (mutants gave the
    secondary key the block's count, or kept a partial entry's extra keys)."""
    layout = full_layout(block_size=8, hash_block_size=4)
    gpu = BlockPool(8)
    gpu.allocate(1)
    gpu.insert_key(key(1), 1, 8)
    gpu.insert_key(key(10), 1, 8)  # secondary: the block's first hash block
    stores = StoreBatch()
    stores.add(1, 1, key(1))
    tier = BlockPool(8, record_events=True, medium="CPU")
    tier.allocate(1)
    registrar = Registrar(layout, Tier.CPU, tier, events=True)
    registrar.register_all(stores, gpu)
    events = [e for e in tier.take_events() if isinstance(e, BlockStored)]
    assert [e.block_size for e in events] == [8, 4]
    partial = registrar.event(key(2), 3, extra_keys=(("lora", "x"),))
    assert (partial.block_size, partial.extra_keys) == (4, None)


def test_slot_records_name_a_tail_s_own_count_and_the_tag() -> None:
    """A persistent slot's record holds the tail's own count even where the GPU block
    holds a whole key, and the KV's tag (mutants recorded the GPU block's count, or no
    tag: a restart never served the slot with the check on)."""
    gpu, stores = gpu_pool_and_items()
    stores.tags[0] = TAG
    registrar = Registrar(full_layout(block_size=4), Tier.DISK, BlockPool(8), events=False)
    records = registrar.records(stores, gpu)
    assert [(r.num_tokens, r.tag) for r in records] == [(4, TAG), (4, None), (4, None), (3, None)]


def tagged_restore() -> tuple[BlockPool, Registrar]:
    tier = BlockPool(8, medium="DISK")
    return tier, Registrar(full_layout(block_size=4), Tier.DISK, tier, events=False, tags=True)


def test_restore_drops_no_slot_out_of_range_and_keeps_untagged_copies_of_an_untagged_key() -> None:
    """Token check on: an untagged record of a key restored with a tag goes to `dropped`
    only for a slot in range (a manifest's bad slot is no slot to drop); two untagged
    copies of a key no tagged record names are both restored (mutants dropped slot 99,
    or treated an untagged key as tagged: slot 3 dropped)."""
    tier, registrar = tagged_restore()
    records = [
        (1, SlotRecord(key(1), 4, TAG)),
        (99, SlotRecord(key(1), 4)),
        (2, SlotRecord(key(2), 4)),
        (3, SlotRecord(key(2), 4)),
    ]
    dropped: list[int] = []
    assert registrar.restore(Tier.DISK, tier, records, dropped) == 3
    assert dropped == []
    assert sorted(tier.cached_blocks(key(2))) == [2, 3]


def test_restore_skips_the_slot_one_past_the_tier() -> None:
    """A manifest slot equal to the tier's block count is out of range: skipped with a
    warning, not an error (a mutant let it through: PoolError at start-up)."""
    tier, registrar = tagged_restore()
    records = [(tier.num_blocks, SlotRecord(key(1), 4, TAG)), (1, SlotRecord(key(2), 4, TAG))]
    assert registrar.restore(Tier.DISK, tier, records) == 1
    assert tier.key(1) == key(2)


def test_restored_events_name_the_restored_tier() -> None:
    """A cascade's disk is restored by the CPU tier's registrar: its events are labelled
    with the disk's medium (a mutant labelled them CPU)."""
    disk = BlockPool(8, record_events=True, medium="DISK")
    registrar = Registrar(full_layout(block_size=4), Tier.CPU, BlockPool(8), events=True)
    assert registrar.restore(Tier.DISK, disk, [(1, SlotRecord(key(1), 4))]) == 1
    events = [e for e in disk.take_events() if isinstance(e, BlockStored)]
    assert [e.medium for e in events] == ["DISK"]
