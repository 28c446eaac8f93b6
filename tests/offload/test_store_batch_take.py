"""`StoreBatch`: stores appended with their tags, and the stores of some GPU blocks taken
out with their extras."""

from __future__ import annotations

import hashlib

from kvtier.core.events import BlockStored
from kvtier.core.keys import Key, make_key
from kvtier.offload.protocols import LoRAInfo
from kvtier.offload.store_batch import StoreBatch


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"split%d" % i).digest(), 0)


def test_take_keeps_each_stores_extras_with_it() -> None:
    payload = BlockStored(b"p" * 32, 0, 16)
    secondary = (BlockStored(b"s" * 32, 0, 8),)
    stores = StoreBatch()
    stores.add(1, 11, key(1), tag=b"t1")
    stores.add(2, 12, key(2), tail_num_tokens=5, payload=payload, tag=b"t2")
    stores.add(3, 13, key(3), payload=payload)
    stores.secondary_payloads[2] = secondary
    stores.add(4, 14, key(4), tag=b"t4")
    lora_a, lora_b = LoRAInfo(1, "a"), LoRAInfo(2, "b")
    stores.loras.update({0: lora_a, 3: lora_b})  # lazy stores' adapters
    stores.counts.update({1: 9, 2: 7})  # keys covering part of their blocks
    stores.extra_keys.update({0: (), 3: (("salt", "s"),)})  # lazy stores' extra keys
    taken = stores.take({2, 4})
    kept = stores
    assert (kept.gpu_block_ids, kept.tier_block_ids, kept.keys) == (
        [1, 3],
        [11, 13],
        [key(1), key(3)],
    )
    assert (kept.tails, kept.payloads, kept.tags) == ({}, {1: payload}, {0: b"t1"})
    assert kept.secondary_payloads == {1: secondary}
    assert (kept.loras, kept.counts, kept.extra_keys) == ({0: lora_a}, {1: 7}, {0: ()})
    assert (taken.gpu_block_ids, taken.tier_block_ids, taken.keys) == (
        [2, 4],
        [12, 14],
        [key(2), key(4)],
    )
    assert (taken.tails, taken.payloads, taken.tags) == ({0: 5}, {0: payload}, {0: b"t2", 1: b"t4"})
    assert taken.secondary_payloads == {}
    assert (taken.loras, taken.counts) == ({1: lora_b}, {0: 9})
    assert taken.extra_keys == {1: (("salt", "s"),)}


def test_extend_tags_the_stores_it_appends_not_the_first_ones() -> None:
    """`extend`'s tags are indexed among the stores it appends (a mutant put them on the
    batch's first stores: another block's tag on store 0, whose copy the check would
    then never serve)."""
    stores = StoreBatch()
    stores.add(1, 11, key(1))
    stores.extend([2, 3], [12, 13], [key(2), key(3)], tags={1: b"t3"})
    assert stores.tags == {2: b"t3"}
    assert stores.take({3}).tags == {0: b"t3"}
