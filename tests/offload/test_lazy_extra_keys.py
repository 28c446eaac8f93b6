"""Lazy stores and hand-offs carry no token payload (SPEC §6.10), but their events carry
the extra keys (LoRA, multimodal items, cache salt) hashed into the block they stored, as
an eager store's event (and vLLM's GPU event of the same hash) has them: the lazy walk
notes them per GPU block when its request finishes; a hand-off reads its request."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sim import SimEngine, config, full_layout, make_request
from test_scenarios_config_events import run_with_handoff, stored_events, three_group_layout

from kvtier.core.extra_keys import MultiModalItem, RequestExtras
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode
from kvtier.offload.lazy_walk import LazyWalk
from kvtier.offload.protocols import LoRAInfo

EXTRAS = {
    "plain": RequestExtras(),
    "salt": RequestExtras(cache_salt="tenant-1"),
    "mm": RequestExtras(mm_items=(MultiModalItem("img-1", 2, 7),)),  # blocks 0, 1, 2
}


def extra_keys_by_hash(engine: SimEngine) -> dict[tuple[int, bytes], object]:
    events = stored_events(engine.scheduler.take_events())
    return {(e.group_id, e.block_hash): e.extra_keys for e in events}


@pytest.mark.parametrize("lora", [None, LoRAInfo(7, "sql")], ids=["base", "lora"])
@pytest.mark.parametrize("extras", list(EXTRAS))
def test_lazy_stores_carry_the_extra_keys_of_eager_stores(
    extras: str, lora: LoRAInfo | None
) -> None:
    """The same prompt stored eagerly and lazily: every lazy event's extra keys equal the
    eager event's of its hash (a block of none says `()`, known, not None)."""

    def request() -> object:
        return make_request("a", range(16), lora=lora, extras=EXTRAS[extras])

    eager = SimEngine(full_layout(), config(events=True))
    eager.run(request())  # type: ignore[arg-type]
    eager.drain()
    expected = extra_keys_by_hash(eager)
    lazy = SimEngine(
        full_layout(),
        config(events=True, store_mode=StoreMode.LAZY, max_batched_tokens=16),
        num_gpu_blocks=9,
    )
    lazy.run(request())  # type: ignore[arg-type]
    for _ in range(3):  # the walk copies the finished request's freed blocks
        lazy.step()
    lazy.drain()
    got = extra_keys_by_hash(lazy)
    assert len(expected) == 4
    assert got == expected
    if extras != "plain" or lora is not None:
        assert any(got.values())


@pytest.mark.parametrize("mode", [StoreMode.EAGER, StoreMode.LAZY])
def test_a_hand_off_s_event_carries_its_block_s_extra_keys(mode: StoreMode) -> None:
    """A state group's block handed off (no token payload): its event carries the extra
    keys of its hash's block, as an eager event of the same hash in another group does."""
    cfg = config(events=True, store_mode=mode, max_batched_tokens=8)
    engine = SimEngine(three_group_layout(), cfg, num_gpu_blocks=32)
    extras = RequestExtras(cache_salt="t", mm_items=(MultiModalItem("img", 5, 2),))
    a = make_request("a", range(8), outputs=[5, 6], extras=extras)
    run_with_handoff(engine, a)
    events = {(e.group_id, e.block_hash): e for e in stored_events(engine.scheduler.take_events())}
    handed_off = events[(2, a.block_hashes[1])]
    assert handed_off.token_ids == ()
    assert handed_off.extra_keys == a.block_extra_keys(4, 8) != ()
    if mode is StoreMode.EAGER:
        assert handed_off.extra_keys == events[(0, a.block_hashes[1])].extra_keys


def test_a_block_used_again_loses_what_was_noted_of_its_last_request() -> None:
    """Blocks noted when a request finishes (its adapter, its extra keys) that another
    request then fills and frees unfinished (preempted) are stored under that request's
    keys: their events never name the first request's adapter or extra keys (unknown
    extra keys, None, are right: nothing noted them at a finish)."""
    cfg = config(events=True, store_mode=StoreMode.LAZY, max_batched_tokens=16)
    engine = SimEngine(full_layout(), cfg, num_gpu_blocks=5, num_tier_blocks=12)
    salt = RequestExtras(cache_salt="tenant-1")
    first = make_request("a", range(16), lora=LoRAInfo(7, "sql"), extras=salt)
    engine.run(first)  # type: ignore[arg-type]
    engine.drain()
    engine.scheduler.take_events()
    second = make_request("b", range(100, 116), extras=RequestExtras(cache_salt="tenant-2"))
    assert engine.admit(second) is not None  # type: ignore[arg-type]
    engine.schedule("b")
    assert set(engine.tables["b"][0]) == set(range(1, 5))  # the first request's blocks
    engine.step()
    engine.preempt("b")
    for _ in range(3):  # the walk copies its freed blocks
        engine.step()
    engine.drain()
    events = {e.block_hash: e for e in stored_events(engine.scheduler.take_events())}
    hashes = list(second.block_hashes)
    assert set(events) == set(hashes)  # the walk stored its four blocks
    for pos, block_hash in enumerate(hashes):
        event = events[block_hash]
        assert (event.lora_id, event.lora_name) == (None, None)
        assert event.extra_keys in (None, second.block_extra_keys(4 * pos, 4 * pos + 4))


class KeyedPool:
    """A GPU pool reduced to what `note_finished` reads: each block's primary key."""

    def __init__(self, keys: dict[int, bytes | None]) -> None:
        self.held = keys

    def keys(self, block_ids: Sequence[int]) -> list[bytes | None]:
        return [self.held.get(b) for b in block_ids]


def test_a_finish_notes_each_block_under_its_own_position_s_key_only() -> None:
    """Two groups, one of 8-token blocks over 4-token hashes: a finished request's block
    is noted with the extra keys of its own position (the salt in block 0, an item in a
    later block) only while it holds the request's key of that position; a block under
    another key (a mid-block hash, another group's) or past the hashed prefix is not."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 8, 64),
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
        ),
        4,
    )
    extras = RequestExtras(cache_salt="t", mm_items=(MultiModalItem("img", 17, 2),))
    r = make_request("r", range(26), extras=extras)
    h = r.block_hashes
    assert len(h) == 6
    pool = KeyedPool(
        {
            10: make_key(h[1], 0),
            11: make_key(h[2], 0),
            12: make_key(h[5], 0),
            13: None,
            **{20 + i: make_key(h[i], 1) for i in range(6)},
            23: make_key(h[3], 0),
            26: None,
        }
    )
    walk = LazyWalk(record_loras=True)
    walk.extra_keys[99] = ("other",)
    walk.note_finished(layout, r, [[10, 11, 12, 13], list(range(20, 27))], pool)  # type: ignore[arg-type]
    assert walk.extra_keys == {
        99: ("other",),
        10: r.block_extra_keys(0, 8),
        12: r.block_extra_keys(16, 24),
        **{20 + i: r.block_extra_keys(4 * i, 4 * i + 4) for i in (0, 1, 2, 4, 5)},
    }
    assert all(walk.extra_keys[b] for b in (10, 20))  # the salt
    assert all(walk.extra_keys[b] for b in (12, 24))  # the item
    assert walk.extra_keys[12] != walk.extra_keys[10]


@pytest.mark.parametrize("chunk", [8, 10], ids=["whole-blocks", "partial-block"])
def test_a_request_aborted_mid_prefill_notes_its_computed_blocks(chunk: int) -> None:
    """A request aborted after its first prefill chunk: its table is shorter than its
    prompt's hashes (and after a partial chunk its last block holds no key). Its finish
    notes the extra keys of the whole blocks it computed, and the walk stores those
    blocks with them, as for a request that ran to its end."""
    cfg = config(events=True, store_mode=StoreMode.LAZY, max_batched_tokens=16)
    engine = SimEngine(full_layout(), cfg, num_gpu_blocks=9)
    request = make_request("a", range(16), extras=RequestExtras(cache_salt="tenant-1"))
    assert engine.admit(request) is not None  # type: ignore[arg-type]
    engine.schedule("a", chunk)
    engine.step()
    engine.finish("a")
    for _ in range(3):  # the walk copies its freed blocks
        engine.step()
    engine.drain()
    hashes = request.block_hashes
    assert extra_keys_by_hash(engine) == {
        (0, hashes[i]): request.block_extra_keys(4 * i, 4 * i + 4) for i in range(2)
    }
