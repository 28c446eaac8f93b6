"""What a request says about its blocks (`offload/block_payload.py`), where a block spans
several hash blocks or a layout has several groups: a block's key is its last hash's in
its own group, none before that hash exists, a payload's extra keys cover the whole
block, and a partly hashed block's partial entries stop at its last hash; a hand-off
names the adapter of its own request, or the one noted for its GPU block."""

from __future__ import annotations

from sim import BYTES_PER_BLOCK, full_layout, make_request

from kvtier.core.extra_keys import MultiModalItem, RequestExtras
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.block_payload import (
    block_payload,
    describe_handoff,
    key_extra_keys,
    request_key,
    secondary_payloads,
    tail_payload,
)
from kvtier.offload.protocols import Handoff, LoRAInfo, ScheduledRequest, StepInput
from kvtier.offload.store_batch import StoreBatch


def test_a_large_blocks_key_is_its_last_hash_blocks_and_none_before_it_is_hashed() -> None:
    """Blocks of 8 tokens over hash blocks of 4: 12 tokens hash 3 blocks, block 0's key
    is hash 1's (a mutant took hash 0's, a partial entry's key), block 1 has none yet
    (a mutant read past the hashes: IndexError)."""
    layout = full_layout(block_size=8, hash_block_size=4)
    request = make_request("a", range(12))
    hashes = request.block_hashes
    assert len(hashes) == 3
    assert request_key(layout, request, 0, 0) == make_key(hashes[1], 0)
    assert request_key(layout, request, 0, 1) is None


def test_a_keys_group_is_the_group_asked_for() -> None:
    """A sliding-window group's key (the one a null block is recovered by) is made for
    that group (a mutant made every key group 0's: the full group's block was found)."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, BYTES_PER_BLOCK),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, BYTES_PER_BLOCK, sliding_window=8),
        )
    )
    request = make_request("a", range(8))
    assert request_key(layout, request, 1, 1) == make_key(request.block_hashes[1], 1)


def test_a_large_blocks_payload_carries_the_extra_keys_of_all_its_tokens() -> None:
    """An image in block 0's second hash block: the block's payload names it (a mutant
    took the extra keys of its first hash block only)."""
    layout = full_layout(block_size=8, hash_block_size=4)
    image = MultiModalItem("image", 5, 2)
    request = make_request("a", range(16), extras=RequestExtras(mm_items=(image,)))
    payload = block_payload(layout, request, 0, 0)
    assert payload.extra_keys == request.block_extra_keys(0, 8)
    assert payload.extra_keys != request.block_extra_keys(0, 4)


def test_a_partly_hashed_blocks_partial_entries_stop_at_its_last_hash() -> None:
    """Blocks of 16 tokens over hash blocks of 4, 20 tokens: block 1 has one hash so far,
    and its partial entry's payload is found (a mutant read hashes past the last:
    IndexError)."""
    layout = full_layout(block_size=16, hash_block_size=4)
    request = make_request("a", range(20))
    hashes = request.block_hashes
    assert len(hashes) == 5
    keys = [make_key(hashes[4], 0)]
    assert secondary_payloads(layout, request, 0, 1, keys) == (
        tail_payload(layout, request, 0, 20),
    )


def one_handoff() -> tuple[StoreBatch, Handoff]:
    """Return a queue holding one hand-off of request b's GPU block 5, and the hand-off."""
    return StoreBatch([5], [1], [make_key(b"h" * 8, 0)]), Handoff("b", 0, 5)


def test_a_hand_off_untracked_names_the_adapter_its_step_schedules_for_its_request() -> None:
    """The step schedules a (adapter A) before b (adapter B): b's hand-off names B (a
    mutant took the first scheduled request's: A)."""
    queued, handoff = one_handoff()
    lora_a, lora_b = LoRAInfo(1, "A"), LoRAInfo(2, "B")
    step = StepInput(
        scheduled=(
            ScheduledRequest(make_request("a", range(8), lora=lora_a), [[1, 2]], 8),
            ScheduledRequest(make_request("b", range(8), lora=lora_b), [[3, 5]], 8),
        )
    )
    describe_handoff(queued, handoff, None, step, {}, None)
    assert queued.loras == {0: lora_b}


def test_a_hand_off_of_a_request_not_seen_names_the_adapter_noted_for_its_block() -> None:
    """No view, no step: the adapter the lazy walk noted for the GPU block (a mutant
    named none)."""
    queued, handoff = one_handoff()
    lora = LoRAInfo(3, "C")
    describe_handoff(queued, handoff, None, None, {5: lora, 6: LoRAInfo(4, "D")}, None)
    assert queued.loras == {0: lora}


def test_only_a_whole_blocks_key_has_the_extra_keys_of_a_block() -> None:
    """Group 0 of 8-token blocks, group 1 of 4-token blocks, hash blocks of 4, an image
    at token 7: hash 1's group-0 key is block 0's, with its 8 tokens' extra keys (a
    mutant stopped at token 7); hash 0's group-0 key is a partial entry's, with none
    known (a mutant gave it a block's before the first); hash 0's group-1 key is a
    whole block's (mutants read group 0's sizes, or never looked at hash 0); a key the
    request does not name, or none, has none (mutants)."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 8, BYTES_PER_BLOCK),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, BYTES_PER_BLOCK, sliding_window=8),
        ),
        configured_hash_block_size=4,
    )
    image = MultiModalItem("image", 7, 1)
    request = make_request("a", range(16), extras=RequestExtras(mm_items=(image,)))
    hashes = request.block_hashes
    whole = request.block_extra_keys(0, 8)
    assert whole != request.block_extra_keys(0, 7)
    assert key_extra_keys(layout, request, make_key(hashes[1], 0)) == whole
    assert key_extra_keys(layout, request, make_key(hashes[0], 0)) is None
    assert key_extra_keys(layout, request, make_key(hashes[0], 1)) == request.block_extra_keys(0, 4)
    assert key_extra_keys(layout, request, make_key(b"x" * 8, 0)) is None
    assert key_extra_keys(layout, request, None) is None
