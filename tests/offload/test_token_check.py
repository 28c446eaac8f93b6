"""SPEC §3 Beyond: the token check on hit. A tier block is served only where its token tag
is the tag the looking-up request computes from its own tokens, so a hash collision costs
a miss, never wrong KV."""

from __future__ import annotations

import logging

import pytest
from collisions import colliding, stored_by_a_sharer
from sim import Admission, SimEngine, SimRequest, block_key, config, full_layout, make_request
from test_scenarios_cascade import cascade_engine, holds, keys_of
from test_scenarios_hybrid import hybrid_engine, store_with_state_handoff

from kvtier.core.keys import make_key
from kvtier.core.token_tags import token_tag
from kvtier.offload.config import CascadeMode, ConfigError, OffloadConfig, StoreMode
from kvtier.offload.plan import SlotRecord, Tier


def checked_engine(token_check: bool = True, **kwargs: object) -> SimEngine:
    """An engine whose tier holds request "a" (tokens 0..7), its GPU cache evicted."""
    engine = SimEngine(
        full_layout(),
        config(token_check=token_check, **kwargs),
        num_gpu_blocks=16,
        num_tier_blocks=8,
    )
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    return engine


def expected_tags(tokens: list[int]) -> list[bytes]:
    tags, parent = [], None
    for start in range(0, len(tokens) - len(tokens) % 4, 4):
        parent = token_tag(parent, tokens[start : start + 4], ())
        tags.append(parent)
    return tags


def test_stored_blocks_carry_the_tags_of_their_tokens_and_hits_are_served() -> None:
    engine = checked_engine()
    tier = engine.scheduler.tier_pool
    a = make_request("probe", range(8))
    slots = [tier.cached_block(block_key(engine.layout, a, 0, pos)) for pos in range(2)]
    assert [tier.tag(s) for s in slots if s is not None] == expected_tags(list(range(8)))

    b = make_request("b", [*range(8), 99])
    assert engine.admit(b) == Admission(0, 8, 8)
    engine.step()
    assert engine.loading == {}  # loaded; poll() checked every block's content
    assert engine.scheduler.take_stats().num_tag_mismatches == 0
    engine.check()


def test_a_collision_counts_once_per_request_however_often_it_is_looked_up() -> None:
    """vLLM looks a waiting request up again every step: one colliding tier block is one
    `tag_mismatches` per request (it counted each lookup). Another request, or the same
    one after it finished, counts it again."""
    engine = checked_engine()
    engine.scheduler.take_stats()
    tokens = [50, 51, 52, 53, 54, 55, 56, 57, 58]
    b = colliding("b", tokens, [*range(8), 58])
    for _ in range(4):
        assert engine.scheduler.lookup(b, 0) == 0
    assert engine.scheduler.has_new_counts()  # the mismatch alone (a lookup counts nothing else)
    assert engine.scheduler.take_stats().num_tag_mismatches == 1
    assert not engine.scheduler.has_new_counts()
    assert engine.scheduler.lookup(colliding("c", tokens, [*range(8), 58]), 0) == 0
    assert engine.scheduler.take_stats().num_tag_mismatches == 1
    engine.scheduler.on_finished(b, [[]])
    assert engine.scheduler.lookup(b, 0) == 0
    assert engine.scheduler.take_stats().num_tag_mismatches == 1


def test_a_forged_hash_collision_is_a_miss_with_the_check_and_wrong_kv_without(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Same block hashes as "a", other tokens: without the check the tier serves a's KV."""
    tokens = [50, 51, 52, 53, 54, 55, 56, 57, 58]
    unchecked = checked_engine(token_check=False)
    assert unchecked.admit(colliding("b", tokens, [*range(8), 58])) == Admission(0, 8, 8)

    engine = checked_engine()
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.load_planner"):
        admission = engine.admit(colliding("b", tokens, [*range(8), 58]))
    assert admission == Admission(0, 0, 0)
    assert engine.scheduler.take_stats().num_tag_mismatches >= 1
    assert "hash collision" in caplog.text
    engine.schedule("b")
    engine.step()
    engine.check()


def test_a_collision_after_a_matching_prefix_ends_the_hit_there() -> None:
    engine = checked_engine()
    b = colliding("b", [0, 1, 2, 3, 70, 71, 72, 73, 9], [*range(8), 9])  # block 1 differs
    assert engine.admit(b) == Admission(0, 4, 4)
    engine.step()
    engine.check()


def test_untagged_tier_blocks_are_not_served() -> None:
    engine = checked_engine()
    tier = engine.scheduler.tier_pool
    key = block_key(engine.layout, make_request("k", range(8)), 0, 0)
    slot = tier.cached_block(key)
    assert slot is not None
    tier.discard_keys(slot)
    tier.touch([slot])
    tier.insert_key(key, slot, 4)  # the same key registered with no tag
    tier.free([slot])
    assert tier.tag(slot) is None
    assert engine.admit(make_request("b", [*range(8), 9])) == Admission(0, 0, 0)
    assert engine.scheduler.take_stats().num_tag_mismatches == 0  # untagged is no mismatch


def test_demotions_carry_tags_and_disk_hits_are_checked() -> None:
    engine = cascade_engine(CascadeMode.WRITE_BACK, num_cpu=9, num_disk=12, token_check=True)
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.run(make_request("b", range(200, 224)))  # pushes "a" down to disk
    for _ in range(3):
        engine.step()
    engine.drain()
    a_keys = keys_of(range(8), 2)
    disk = engine.scheduler.index.pools[Tier.DISK]
    on_disk = [k for k in a_keys if holds(engine, Tier.DISK, k)]
    assert on_disk
    want = dict(zip(a_keys, expected_tags(list(range(8))), strict=True))
    for key in on_disk:
        slot = disk.cached_block(key)
        assert slot is not None
        assert disk.tag(slot) == want[key]
    engine.evict_gpu()
    c = make_request("c", [*range(8), 5])
    assert engine.admit(c) == Admission(0, 8, 8)
    engine.drain()
    engine.check()


def test_fine_grained_tails_and_state_handoffs_carry_tags() -> None:
    """Scenario 23 with the check on: the tail and the handed-off state block are served."""
    engine = hybrid_engine(token_check=True)
    store_with_state_handoff(engine)
    b = make_request("b", [*range(48), 7], 16)
    assert engine.admit(b) == Admission(0, 48, 48)
    engine.step()
    assert engine.loading == {}
    engine.check()


def test_request_tags_are_dropped_at_finish_and_reset() -> None:
    engine = checked_engine()
    tags = engine.scheduler.tags
    assert tags is not None
    assert len(tags) == 0
    engine.admit(make_request("b", [*range(8), 9]))
    assert len(tags) == 1
    engine.drain()
    assert engine.scheduler.reset()
    assert len(tags) == 0


def test_token_check_needs_eager_stores_and_is_a_config_key() -> None:
    with pytest.raises(ConfigError, match="token_check=True needs store_mode='eager'"):
        OffloadConfig(cpu_bytes=1 << 20, token_check=True, store_mode=StoreMode.LAZY)
    assert OffloadConfig.from_dict({"cpu_bytes": 4096, "token_check": True}).token_check
    with pytest.raises(ConfigError, match="token_check must be a bool, got 'yes'"):
        OffloadConfig.from_dict({"cpu_bytes": 4096, "token_check": "yes"})


OTHER_KEY = b"\x01" * 32 + (0).to_bytes(4, "big")


def rekey(engine: SimEngine, block_id: int) -> None:
    """Make a GPU block hold `OTHER_KEY` instead of its own (what vLLM may do to a block)."""
    engine.gpu.discard_keys(block_id)
    engine.gpu.insert_key(OTHER_KEY, block_id, 4)


@pytest.mark.parametrize("events", [False, True], ids=["batched", "events"])
def test_a_block_whose_gpu_key_is_not_the_requests_is_not_stored(events: bool) -> None:
    """No tag is known for its KV, and an untagged copy would never be served while it
    kept the key's tagged copy out. With events on, stores take the per-block path."""
    engine = SimEngine(full_layout(), config(token_check=True, events=events), num_tier_blocks=8)
    engine.auto_complete = False
    engine.admit(make_request("a", range(8)))
    engine.schedule("a")
    engine.step()  # computed; eager selection waits for the finish (one step)
    rekey(engine, engine.tables["a"][0][0])
    engine.scheduler.take_stats()
    engine.finish("a")
    assert engine.scheduler.take_stats().store_outcomes == {
        "stored": 1,
        "skipped_no_token_tag": 1,
    }
    engine.auto_complete = True
    engine.drain()
    tier = engine.scheduler.tier_pool
    assert tier.cached_block(OTHER_KEY) is None
    own = tier.cached_block(block_key(engine.layout, make_request("k", range(8)), 0, 1))
    assert own is not None
    assert tier.tag(own) == expected_tags(list(range(8)))[1]


@pytest.mark.parametrize("events", [False, True], ids=["batched", "events"])
def test_a_block_rekeyed_while_its_copy_is_in_flight_registers_nothing(events: bool) -> None:
    # The copy may predate the tokens of the key the block holds now, and holds the
    # selected key's KV only if the block still has it (test_vllm_promoted_key_store).
    engine = SimEngine(full_layout(), config(token_check=True, events=events), num_tier_blocks=8)
    store = engine.store_of_finished(make_request("a", range(8)))
    rekey(engine, store.src_block_ids[0])
    engine.auto_complete = True
    engine.drain()
    tier = engine.scheduler.tier_pool
    assert tier.cached_block(OTHER_KEY) is None
    own = tier.cached_block(block_key(engine.layout, make_request("k", range(8)), 0, 0))
    assert own is None
    assert tier.cached_block(block_key(engine.layout, make_request("k", range(8)), 0, 1))


# ---------------------------------------------------------------- review regressions

H = bytes(range(32))


class FixedHasher:
    """A request hasher whose block hashes are given (a forged collision model)."""

    def __init__(self, hashes: list[bytes]) -> None:
        self.block_hashes = hashes

    def block_extra_keys(self, start: int, end: int) -> tuple[object, ...]:
        return ()

    def extend(self, tokens: list[int]) -> None:
        pass


def self_colliding(request_id: str, tokens: list[int]) -> SimRequest:
    """Two hash blocks with the same hash (the chain collides with itself)."""
    return SimRequest(request_id, tokens, len(tokens), FixedHasher([H, H]))  # type: ignore[arg-type]


def test_a_hash_a_request_holds_twice_is_never_checked_by_hash() -> None:
    """Block 1's KV stored under the hash both blocks share must not pass at position 0."""
    tokens = [10, 11, 12, 13, 20, 21, 22, 23, 30]
    engine = SimEngine(full_layout(), config(token_check=True), num_tier_blocks=8)
    engine.admit(self_colliding("d", list(tokens)))
    engine.schedule("d", 4)
    engine.step()
    engine.schedule("d", 4)
    engine.step()  # block 0 stored under H
    tier = engine.scheduler.tier_pool
    key = make_key(H, 0)
    tier.discard_keys(tier.cached_block(key) or 0)  # the tier evicts it
    engine.schedule("d", 1)
    engine.step()  # block 1 stored under H, with block 1's tag
    engine.finish("d")
    engine.drain()
    engine.evict_gpu()
    slot = tier.cached_block(key)
    assert slot is not None
    assert tier.tag(slot) == expected_tags(tokens)[1]
    assert engine.admit(self_colliding("e", list(tokens))) == Admission(0, 0, 0)
    engine.check()


def test_a_block_shared_from_the_gpu_cache_keeps_its_fillers_tag() -> None:
    """B collides with A and gets A's blocks from the GPU prefix cache (no check there).
    B's store copies A's KV, so it must carry A's tag, never B's: C, with B's tokens,
    is not served A's KV from the tier."""
    engine = SimEngine(full_layout(), config(token_check=True), num_tier_blocks=8)
    a_tokens = [*range(8), 8]
    engine.run(make_request("a", a_tokens))
    engine.drain()
    tier = engine.scheduler.tier_pool
    for slot in range(1, tier.num_blocks):
        if tier.key(slot) is not None:
            tier.discard_keys(slot)  # A's tier copies evicted; its GPU copies remain
    b_tokens = [50, 51, 52, 53, 54, 55, 56, 57, 58]
    assert engine.admit(colliding("b", b_tokens, a_tokens)) == Admission(8, 0, 0)
    engine.schedule("b")
    engine.step()
    engine.finish("b")
    engine.drain()
    a_request = make_request("k", a_tokens)
    slots = [tier.cached_block(block_key(engine.layout, a_request, 0, i)) for i in range(2)]
    assert [tier.tag(s) for s in slots if s is not None] == expected_tags(a_tokens)[:2]
    engine.evict_gpu()
    assert engine.admit(colliding("c", b_tokens, a_tokens)) == Admission(0, 0, 0)
    assert engine.admit(make_request("a2", a_tokens)) == Admission(0, 8, 8)  # A's own: served
    engine.check()


def test_a_key_held_as_a_secondary_key_is_a_quiet_miss() -> None:
    """Tags go with primary keys: a tier block found by a secondary key (a fine-grained
    tail key vLLM adds) is not served, and it is no 'hash collision' either."""
    layout = full_layout(block_size=8, hash_block_size=4)
    engine = SimEngine(layout, config(token_check=True, fine_grained_hits=True), num_tier_blocks=8)
    a = make_request("a", [*range(16), 99], 4)
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    tail = make_key(a.block_hashes[2], 0)  # hash block 2 ends inside GPU block 1
    engine.gpu.insert_key(tail, engine.tables["a"][0][1], 4)  # held as a secondary key
    engine.finish("a")
    engine.drain()
    engine.evict_gpu()
    tier = engine.scheduler.tier_pool
    slot = tier.cached_block(tail)
    assert slot is not None
    assert tail in tier.secondary_keys(slot)
    engine.scheduler.take_stats()
    admission = engine.admit(make_request("b", [*range(12), 70, 71, 72, 73, 5], 4))
    assert admission == Admission(0, 8, 8)  # the first block; the tail is not served
    assert engine.scheduler.take_stats().num_tag_mismatches == 0


@pytest.mark.parametrize("token_check", [False, True])
def test_restored_tags_are_kept_only_with_the_check_and_untagged_slots_are_named(
    token_check: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the check, restored tags would only slow the pool's eviction path; with
    it, blocks a run without the check kept are never served, which a warning says."""
    engine = SimEngine(full_layout(), config(token_check=token_check), num_tier_blocks=8)
    keys = keys_of(range(8), 2)
    records = [(1, SlotRecord(keys[0], 4, b"t" * 16)), (2, SlotRecord(keys[1], 4))]
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.registration"):
        assert engine.scheduler.restore(Tier.CPU, records) == 2
    tier = engine.scheduler.tier_pool
    assert (tier.tag(1), tier.tag(2)) == ((b"t" * 16 if token_check else None), None)
    assert ("1 of 2 restored blocks carry no token tag" in caplog.text) == token_check
    engine.check()


def test_a_reused_gpu_block_forgets_the_tag_of_its_earlier_fill() -> None:
    """A fills GPU blocks; D, colliding with A, fills the same blocks anew and is
    preempted before its blocks are noted; B shares them from the GPU cache and stores
    them. They hold D's KV: A's old note must not tag them, or A's tokens get D's KV."""
    engine = SimEngine(full_layout(), config(token_check=True), num_gpu_blocks=4)
    a_tokens = [*range(8), 8]
    engine.run(make_request("a", a_tokens))
    engine.drain()
    a_blocks = set(engine.worker.stores()[0].src_block_ids)
    tier = engine.scheduler.tier_pool
    for slot in range(1, tier.num_blocks):
        if tier.key(slot) is not None:
            tier.discard_keys(slot)
    engine.evict_gpu()
    d_tokens = [60, 61, 62, 63, 64, 65, 66, 67, 68]
    engine.admit(colliding("d", d_tokens, a_tokens))
    engine.schedule("d")
    engine.step()  # D computes into A's old blocks (3 usable: it must reuse them)
    assert a_blocks <= set(engine.tables["d"][0])
    b_tokens = [70, 71, 72, 73, 74, 75, 76, 77, 78]
    assert stored_by_a_sharer(engine, b_tokens, a_tokens) == Admission(8, 0, 0)
    assert engine.admit(make_request("a2", a_tokens)) == Admission(0, 0, 0)


def test_finished_requests_and_resets_leave_no_request_state_or_notes() -> None:
    engine = checked_engine()  # "a" ran and finished
    tags = engine.scheduler.tags
    assert tags is not None
    b = make_request("b", [*range(8), 9])
    engine.run(b)  # a tier hit, then finished
    c = make_request("c", [*range(8), 10])
    assert engine.admit(c) == Admission(8, 0, 0)  # b's blocks, from the GPU cache
    assert tags.floor("c", 0) == 2
    engine.schedule("c")
    engine.step()
    engine.finish("c")
    assert (len(tags), tags.floor("c", 0)) == (0, 0)  # its local prefix is forgotten
    table = engine.worker.stores()[0].src_block_ids
    key = engine.gpu.key(table[0])
    assert key is not None
    noted = [tags.noted(block, engine.gpu.key(block) or b"") for block in table]
    assert any(noted), "finished requests' fills stay noted (their blocks stay cached)"
    engine.drain()
    assert engine.scheduler.reset()
    assert not any(tags.noted(block, engine.gpu.key(block) or b"") for block in table)
