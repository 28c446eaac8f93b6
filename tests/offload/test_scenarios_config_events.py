"""SPEC §9 scenarios 27 (configuration errors) and 29 (KV events)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim import SimEngine, SimRequest, config, full_layout, make_request

from kvtier.core.events import AllCleared, BlockRemoved, BlockStored, KVEvent
from kvtier.core.hashing import HashAlgo
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import (
    CascadeMode,
    ConfigError,
    DiskIOMode,
    OffloadConfig,
    StoreMode,
    agree_num_tier_blocks,
)
from kvtier.offload.plan import Tier
from kvtier.offload.protocols import LoRAInfo
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup

# ---------------------------------------------------------------------------- scenario 27


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"disk_bytes": -1, "disk_path": "/x"}, r"disk_bytes=-1"),
        ({"disk_bytes": 0, "disk_path": "/x"}, r"disk_bytes"),
        ({"cpu_bytes": -64}, r"cpu_bytes=-64"),
        ({"cpu_bytes": 640, "num_blocks": 0}, r"num_blocks=0"),
        ({"cpu_bytes": 640, "num_blocks": -3}, r"num_blocks=-3"),
        ({"cpu_bytes": 640, "num_blocks": 4.0}, r"num_blocks.*4\.0"),
        ({"cpu_bytes": 640, "num_blocks": "4"}, r"num_blocks.*'4'"),
        ({"cpu_bytes": 640, "num_blocks": True}, r"num_blocks.*True"),
        ({"cpu_bytes": "1GiB"}, r"cpu_bytes.*'1GiB'"),
        ({"cpu_bytes": 640, "store_mode": "eagerly"}, r"store_mode.*'eagerly'"),
    ],
)
def test_scenario_27_invalid_values_raise_a_config_error_naming_key_and_value(
    values: dict[str, object], match: str
) -> None:
    """Scenario 27: an invalid value raises ConfigError naming the key and the value."""
    with pytest.raises(ConfigError, match=match):
        OffloadConfig.from_dict(values)


def test_scenario_27_unknown_key_is_rejected_by_name() -> None:
    """Scenario 27: an unknown key raises ConfigError naming it, and the closest known key."""
    with pytest.raises(ConfigError, match="cpu_byte"):
        OffloadConfig.from_dict({"cpu_bytes": 640, "cpu_byte": 640})
    values = {"cpu_bytes": 640, "disk_buffer_slot": 4, "zzz": 1, "disk_direct_i": True}
    with pytest.raises(ConfigError) as error:
        OffloadConfig.from_dict(values)
    assert str(error.value).startswith(
        "unknown offload config keys: disk_buffer_slot (did you mean 'disk_buffer_slots'?), "
        "disk_direct_i (did you mean 'disk_direct_io'?), zzz; valid keys: admission_policy, "
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"disk_path": 5}, "disk_path must be a str, got 5"),
        ({"disk_buffer_slots": "8"}, "disk_buffer_slots must be an int, got '8'"),
        ({"disk_io_mode": "fast"}, "disk_io_mode must be one of"),
        ({"cascade": "write_sideways"}, "cascade must be one of"),
        ({"cascade": 1}, "cascade must be one of .*, got 1"),
    ],
)
def test_scenario_27_ignored_keys_are_still_checked(
    values: dict[str, object], message: str
) -> None:
    """Keys a CPU-only config ignores keep their checks: a typo is an error, not a warning."""
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict({"cpu_bytes": 640, **values})


@pytest.mark.parametrize("slots", [0, -1])
def test_scenario_27_ignored_keys_keep_their_range_checks(slots: int) -> None:
    """Regression: disk_buffer_slots=0 without a disk tier was accepted with a warning."""
    message = f"disk_buffer_slots={slots} is invalid: must be >= 1"
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict({"cpu_bytes": 640, "disk_buffer_slots": slots})
    with pytest.raises(ConfigError, match=message):  # the same as with a disk tier
        OffloadConfig.from_dict({"disk_bytes": 640, "disk_path": "/x", "disk_buffer_slots": slots})


def test_scenario_27_policy_names_ignore_case() -> None:
    """Regression: eviction_policy='ARC' was refused, though the vLLM `policy` key ignores case."""
    values = {"cpu_bytes": 640, "eviction_policy": " S3FIFO ", "admission_policy": "Door"}
    config = OffloadConfig.from_dict(values)
    assert (config.eviction_policy, config.admission_policy) == ("s3fifo", "door")
    assert OffloadConfig(cpu_bytes=640, eviction_policy="LRU").eviction_policy == "lru"
    with pytest.raises(ConfigError, match="eviction_policy='MRU' is invalid: choose one of lru"):
        OffloadConfig(cpu_bytes=640, eviction_policy="MRU")


def test_scenario_27_enum_values_ignore_case() -> None:
    """Regression: store_mode='LAZY' was refused while policy names ignore case."""
    values = {"cpu_bytes": 640, "disk_bytes": 640, "disk_path": "/x", "store_mode": "LAZY"}
    config = OffloadConfig.from_dict(
        {**values, "disk_io_mode": " Page_Cache", "cascade": "Write_Back", "hash_algo": "XXHASH"}
    )
    assert config.store_mode is StoreMode.LAZY
    assert config.disk_io_mode is DiskIOMode.PAGE_CACHE
    assert config.cascade is CascadeMode.WRITE_BACK
    assert config.hash_algo is HashAlgo.XXHASH
    with pytest.raises(ConfigError, match="store_mode must be one of 'eager', 'lazy', got 'Lazzy'"):
        OffloadConfig.from_dict({"cpu_bytes": 640, "store_mode": "Lazzy"})


def test_scenario_27_disk_capacity_below_two_blocks_is_rejected() -> None:
    """Scenario 27: a disk budget holding fewer than 2 blocks raises, naming disk_bytes."""
    cfg = OffloadConfig(disk_bytes=100, disk_path="/x")
    with pytest.raises(ConfigError, match=r"disk_bytes=100"):
        cfg.num_tier_blocks(64)


def test_scenario_27_explicit_block_count_must_fit_the_budget() -> None:
    """Scenario 27: num_blocks above what the bytes hold raises; at or below it is used."""
    with pytest.raises(ConfigError, match=r"num_blocks=11.*cpu_bytes=640"):
        OffloadConfig(cpu_bytes=640, num_blocks=11).num_tier_blocks(64)
    assert OffloadConfig(cpu_bytes=640, num_blocks=10).num_tier_blocks(64) == 10
    assert OffloadConfig(cpu_bytes=640, num_blocks=3).num_tier_blocks(64) == 3
    assert OffloadConfig(cpu_bytes=640).num_tier_blocks(64) == 10


def test_scenario_27_workers_agree_on_the_smallest_tier() -> None:
    """Scenario 27 (SPEC §6.1): with several workers the minimum tier size wins."""
    assert agree_num_tier_blocks([12, 9, 10]) == 9
    with pytest.raises(ConfigError):
        agree_num_tier_blocks([])


def test_scenario_27_scheduler_rejects_zero_workers_before_allocating() -> None:
    """Scenario 27: a scheduler with no worker is refused at construction."""
    with pytest.raises(ValueError, match="num_workers"):
        OffloadScheduler(config(), SchedulerSetup(full_layout(), 8, num_workers=0))


# ---------------------------------------------------------------------------- scenario 29


def stored_events(events: list[KVEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def test_scenario_29_events_off_records_nothing() -> None:
    """Scenario 29: with events off, stores, evictions and reset emit no event."""
    engine = SimEngine(full_layout(), num_tier_blocks=3)
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.run(make_request("b", range(100, 108)))  # evicts a's slots
    engine.drain()
    assert engine.scheduler.reset() is True
    assert engine.scheduler.take_events() == []


def three_group_layout() -> KVLayout:
    return KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 8),
            KVGroupSpec(GroupKind.STATE, 4, 64),
        )
    )


def run_with_handoff(engine: SimEngine, request: SimRequest) -> None:
    """Compute the request's prompt, hand off its last state block, decode once, finish."""
    engine.admit(request, accept=0)
    engine.schedule(request.request_id)
    engine.step()
    state = engine.tables[request.request_id][2]
    engine.handoff(request.request_id, 2, state[request.num_prompt_tokens // 4 - 1])
    engine.schedule(request.request_id)
    engine.step()
    engine.finish(request.request_id)
    engine.drain()


def test_scenario_29_block_stored_fields_follow_the_group_kind() -> None:
    """Scenario 29: eager BlockStored events carry token payload, kind and window per group."""
    engine = SimEngine(three_group_layout(), config(events=True), num_gpu_blocks=32)
    a = make_request("a", range(8), outputs=[5, 6])
    run_with_handoff(engine, a)
    events = {(e.group_id, e.block_hash): e for e in stored_events(engine.scheduler.take_events())}
    for group_id, kind, window in ((0, "full_attention", None), (1, "sliding_window", 8)):
        for pos in (0, 1):
            event = events[(group_id, a.block_hashes[pos])]
            assert event.group_kind == kind
            assert event.sliding_window == window
            assert event.block_size == 4
            assert event.token_ids == tuple(range(4 * pos, 4 * pos + 4))
            assert event.parent_block_hash == (a.block_hashes[0] if pos else None)
            assert (event.lora_id, event.lora_name, event.medium) == (None, None, "CPU")
    handed_off = events[(2, a.block_hashes[1])]
    assert handed_off.token_ids == ()  # hand-offs carry no token payload
    assert handed_off.medium == "CPU"


def test_scenario_29_a_block_of_two_hash_blocks_is_chained_to_the_block_before() -> None:
    """Scenario 29: 8-token blocks over 4-token hash blocks: a block's event names its
    last hash block's hash and, as parent, the previous block's (a mutant named the hash
    block just before its own: hash 2, not hash 1)."""
    engine = SimEngine(full_layout(block_size=8, hash_block_size=4), config(events=True))
    a = make_request("a", range(17))
    engine.run(a)
    engine.drain()
    events = stored_events(engine.scheduler.take_events())
    assert [e.block_hash for e in events] == [a.block_hashes[1], a.block_hashes[3]]
    assert [e.parent_block_hash for e in events] == [None, a.block_hashes[1]]
    assert events[1].token_ids == tuple(range(8, 16))


def test_scenario_29_events_without_payload_still_name_their_group_kind() -> None:
    """Scenario 29: hand-off and lazy BlockStored events (no token payload) keep the group
    kind and sliding window of their group."""
    engine = SimEngine(three_group_layout(), config(events=True), num_gpu_blocks=32)
    run_with_handoff(engine, make_request("a", range(8), outputs=[5, 6]))
    lazy = SimEngine(
        KVLayout(three_group_layout().groups[:2]),
        config(events=True, store_mode=StoreMode.LAZY, max_batched_tokens=8),
        num_gpu_blocks=9,
    )
    lazy.run(make_request("a", range(8)))
    lazy.drain()
    lazy.step()
    lazy_events = stored_events(lazy.scheduler.take_events())
    assert all(event.token_ids == () for event in lazy_events)
    events = stored_events(engine.scheduler.take_events()) + lazy_events
    assert len(events) == 2 + 2 + 1 + 2 + 2
    kinds = [("full_attention", None), ("sliding_window", 8), ("state", None)]
    for event in events:
        assert (event.group_kind, event.sliding_window) == kinds[event.group_id]


def test_scenario_29_lora_fields_are_carried() -> None:
    """Scenario 29: a LoRA request's events carry its adapter id and name."""
    engine = SimEngine(full_layout(), config(events=True))
    lora = LoRAInfo(7, "sql-adapter")
    a = make_request("a", range(8), lora=lora)
    engine.run(a)
    engine.drain()
    events = stored_events(engine.scheduler.take_events())
    assert len(events) == 2
    assert {(e.lora_id, e.lora_name) for e in events} == {(7, "sql-adapter")}
    plain = make_request("plain", [*range(8), 9])
    assert engine.scheduler.lookup(plain, 0) == 0  # the adapter is part of the hash


def test_scenario_29_the_session_is_carried() -> None:
    """Scenario 29: a request's eager BlockStored events name its session (as vLLM's GPU
    events do); a request without one names none."""
    engine = SimEngine(full_layout(), config(events=True))
    chat = make_request("chat", range(8))
    chat.session_id = "conversation-7"
    engine.run(chat)
    engine.run(make_request("plain", range(100, 108)))
    engine.drain()
    events = stored_events(engine.scheduler.take_events())
    assert [e.session_id for e in events] == ["conversation-7"] * 2 + [None] * 2


def test_scenario_29_extra_keys_are_carried() -> None:
    """Scenario 29: eager BlockStored events carry the extra keys hashed into each block."""
    engine = SimEngine(full_layout(), config(events=True))
    engine.run(make_request("a", range(8), lora=LoRAInfo(7, "sql-adapter")))
    engine.run(make_request("plain", range(100, 108)))
    engine.drain()
    events = stored_events(engine.scheduler.take_events())
    assert len(events) == 4
    assert [e.extra_keys for e in events if e.lora_id == 7] == [(("lora", "sql-adapter"),)] * 2
    assert [e.extra_keys for e in events if e.lora_id is None] == [(), ()]


@pytest.mark.parametrize("medium", ["CPU", "DISK"])
def test_scenario_29_events_carry_the_tier_medium(medium: str, tmp_path: Path) -> None:
    """Scenario 29: BlockStored, BlockRemoved and AllCleared are labelled with the tier."""
    if medium == "DISK":
        cfg = OffloadConfig(disk_bytes=1 << 20, disk_path=str(tmp_path / "tier"), events=True)
    else:
        cfg = config(events=True)
    engine = SimEngine(full_layout(), cfg, num_tier_blocks=3)
    assert engine.scheduler.tier is Tier(medium)
    a = make_request("a", range(8))
    engine.run(a)
    engine.drain()
    engine.run(make_request("b", range(100, 104)))  # evicts one of a's two slots
    engine.drain()
    assert {job.dst_tier for job in engine.worker.stores()} == {Tier(medium)}
    assert engine.scheduler.reset() is True
    events = engine.scheduler.take_events()
    assert {e.medium for e in events} == {medium}
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1
    assert removed[0].block_hash in a.block_hashes
    assert events[-1] == AllCleared(medium)
    assert len(stored_events(events)) == 3
