"""`KVTierConnector`'s KV events and connector stats in vLLM's formats (its Prometheus
metrics: test_vllm_prometheus.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    SLOT_BYTES,
    drain_collecting_stats,
    freeze_stats_clock,
    kvtier_config,
    kvtier_harness,
)
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm_harness import (
    VllmHarness,
    connector_worker_factory,
    flatten_events,
    shared_prefix_prompts,
)

from kvtier.adapters.vllm import KVTierConnector, scheduler_stats
from kvtier.adapters.vllm.stats import (
    KVTierStats,
    summed_gauges,
)

PROMPTS = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
AGAIN = {f"again-{r}": [*p, 9] for r, p in PROMPTS.items()}
# The connector's `info` labels for `kvtier_harness()`'s CPU tier of 256 blocks.
CPU_TIER_INFO = {
    "tier": "CPU",
    "store_mode": "eager",
    "num_tier_blocks": "256",
    "disk_io_mode": "",  # no disk tier, no disk I/O mode
    "cascade": "",
    "num_disk_blocks": "",
}


@pytest.fixture(autouse=True)
def _stats_clock_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    freeze_stats_clock(monkeypatch)


def tier_events(harness: VllmHarness, medium: str) -> list[object]:
    events = flatten_events(harness.event_batches)
    return [e for e in events if getattr(e, "medium", medium) == medium]


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_stored_blocks_are_published_with_medium_cpu(scheduling: str) -> None:
    harness = kvtier_harness(enable_kv_events=True, **SCHEDULING[scheduling])
    prompt = list(range(1000, 1041))
    harness.run_requests({"a": prompt}, max_tokens=2)
    stored = [e for e in tier_events(harness, "CPU") if isinstance(e, BlockStored)]
    hashes = harness.requests["a"].block_hashes
    assert [e.block_hashes for e in stored] == [[maybe_convert_block_hash(h)] for h in hashes[:2]]
    assert [e.token_ids for e in stored] == [prompt[:16], prompt[16:32]]
    assert stored[1].parent_block_hash == maybe_convert_block_hash(hashes[0])
    assert {(e.block_size, e.group_idx, e.kv_cache_spec_kind) for e in stored} == {
        (16, 0, "full_attention")
    }
    gpu = [e for e in tier_events(harness, "GPU") if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in gpu) == 2, "the GPU pool's own events come too"


def test_tier_events_carry_the_extra_keys_vllm_publishes_for_the_same_block() -> None:
    """Scenario 29 through vLLM: a salted request's CPU events carry the extra keys that
    vLLM's own GPU events carry for the same hashes."""
    harness = kvtier_harness(enable_kv_events=True)
    harness.add_request("salted", list(range(1000, 1041)), max_tokens=2, cache_salt="tenant-1")
    harness.run()
    stored = [e for e in flatten_events(harness.event_batches) if isinstance(e, BlockStored)]
    gpu = {  # vLLM's own events: one per batch of blocks
        h: keys
        for e in stored
        if e.medium == "GPU"
        for h, keys in zip(
            e.block_hashes, e.extra_keys or [None] * len(e.block_hashes), strict=True
        )
    }
    cpu = {e.block_hashes[0]: (e.extra_keys or [None])[0] for e in stored if e.medium == "CPU"}
    assert len(cpu) == 2
    assert cpu == {h: gpu[h] for h in cpu}
    assert list(cpu.values()) == [("tenant-1",), None]  # the salt is hashed into block 0 only


def test_tier_events_carry_the_session_vllm_publishes_for_the_same_request() -> None:
    """vLLM's GPU events name the session of the request that stored a block; the CPU
    tier's events of that request's blocks name it too (a router keyed by session sees
    both tiers)."""
    harness = kvtier_harness(enable_kv_events=True)
    request = harness.add_request("chat", list(range(1000, 1041)), max_tokens=2)
    request.session_id = "conversation-7"
    harness.run()
    stored = [e for e in flatten_events(harness.event_batches) if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"GPU", "CPU"}
    assert {e.session_id for e in stored} == {"conversation-7"}


def test_tier_evictions_and_resets_are_published() -> None:
    harness = kvtier_harness(num_cpu_blocks=3, enable_kv_events=True)  # 2 usable slots
    for request_id, prompt in PROMPTS.items():  # one at a time: each evicts the last
        harness.run_requests({request_id: prompt}, max_tokens=3)
    removed = [e for e in tier_events(harness, "CPU") if isinstance(e, BlockRemoved)]
    assert removed
    assert all(e.group_idx == 0 for e in removed)
    held = {
        h for e in tier_events(harness, "CPU") if isinstance(e, BlockStored) for h in e.block_hashes
    }
    held -= {h for e in removed for h in e.block_hashes}
    assert held
    before = len(flatten_events(harness.event_batches))
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)
    harness.step()
    after = flatten_events(harness.event_batches)[before:]
    # vLLM's AllBlocksCleared has no medium: the GPU reset publishes its own, and kvtier
    # adds none (a router would read it as clearing the GPU's blocks again).
    assert sum(isinstance(e, AllBlocksCleared) for e in after) == 1
    cleared = [e for e in after if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert {h for e in cleared for h in e.block_hashes} == held


def test_disk_tier_serves_hits_and_publishes_medium_storage(tmp_path: Path) -> None:
    cfg = kvtier_config(
        enable_kv_events=True,
        extra={
            "cpu_bytes": 0,
            "disk_bytes": 64 * SLOT_BYTES,
            "disk_path": str(tmp_path),
            "disk_io_mode": "page_cache",
        },
    )
    harness = VllmHarness(cfg, connector_worker_factory)
    assert [p.name for p in tmp_path.iterdir()] == ["kvtier-rank0.slots"]
    harness.run_requests(PROMPTS, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()
    harness.run_requests(AGAIN, max_tokens=3)
    assert all(harness.external_hit_tokens(r) == 48 for r in AGAIN)
    media = {e.medium for e in flatten_events(harness.event_batches) if isinstance(e, BlockStored)}
    assert media == {"GPU", "STORAGE"}


def collect_stats() -> tuple[VllmHarness, list[dict[str, object]]]:
    harness = kvtier_harness()
    for request_id, prompt in PROMPTS.items():
        harness.add_request(request_id, prompt, max_tokens=3)
    payloads = drain_collecting_stats(harness)
    assert harness.scheduler.reset_prefix_cache()
    for request_id, prompt in AGAIN.items():
        harness.add_request(request_id, prompt, max_tokens=3)
    return harness, payloads + drain_collecting_stats(harness)


def test_connector_stats_aggregate_in_vllms_stats_path() -> None:
    harness, payloads = collect_stats()
    total = KVTierConnector.build_kv_connector_stats()
    for payload in payloads:
        total = total.aggregate(KVTierConnector.build_kv_connector_stats(payload))
    assert isinstance(total, KVTierStats)
    assert not total.is_empty()
    flat = total.reduce()
    assert flat["loaded_blocks"] == 4 * 3
    assert flat["hit_tokens"] == 4 * 48
    assert flat["bytes_loaded"] == 4 * 3 * SLOT_BYTES
    assert flat["stored_blocks"] == flat["store_outcome.stored"] >= 4 * 3
    assert flat["tier_blocks_in_use"] == 0
    (info,) = total.data["info"].values()  # one source: one connector
    assert info == CPU_TIER_INFO
    lines: list[str] = []
    logging = KVConnectorLogging(harness.vllm_config.kv_transfer_config)
    for payload in payloads:
        logging.observe(payload)
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    assert "loaded_blocks=12" in lines[0]


def test_stats_aggregate_adds_counters_and_takes_the_newest_gauges() -> None:
    first = KVTierConnector.build_kv_connector_stats(
        {
            "counters": {"loaded_blocks": 3, "hit_tokens": 48},
            "gauges": {"0": {"tier_blocks_in_use": 5}},
        }
    )
    second = {"counters": {"loaded_blocks": 2}, "gauges": {"0": {"tier_blocks_in_use": 1}}}
    total = first.aggregate(KVTierConnector.build_kv_connector_stats(second))
    assert total.reduce() == {"loaded_blocks": 5, "hit_tokens": 48, "tier_blocks_in_use": 1}
    assert second["counters"] == {"loaded_blocks": 2}


def test_connector_stats_are_none_until_something_changes() -> None:
    """A quiet step returns no stats; the next count or gauge change is reported in full."""
    harness, payloads = collect_stats()
    assert payloads
    connector = harness.scheduler.connector
    assert connector.get_kv_connector_stats() is None
    assert connector.get_kv_connector_stats() is None
    assert harness.scheduler.reset_prefix_cache()  # the GPU's copy goes; the tier's stays
    harness.add_request("late", [*PROMPTS["req-0"], 7], max_tokens=3)
    late = drain_collecting_stats(harness)
    total = KVTierConnector.build_kv_connector_stats()
    for payload in late:
        total = total.aggregate(KVTierConnector.build_kv_connector_stats(payload))
    flat = total.reduce()
    assert flat["hit_tokens"] == 48  # the prefix, served from the tier again
    assert flat["tier_blocks_in_use"] == 0
    assert connector.get_kv_connector_stats() is None


def test_unchanged_gauges_are_sent_again_after_the_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's log line sums one interval's payloads: an engine decoding with nothing
    new for a whole interval sent none, and its gauges dropped out of the line. After
    `STATS_HEARTBEAT_S` without a payload, the gauges go out again, with no counters."""
    harness, _ = collect_stats()
    connector = harness.scheduler.connector
    assert connector.get_kv_connector_stats() is None
    sent_at = scheduler_stats._clock()
    later = sent_at + scheduler_stats.STATS_HEARTBEAT_S
    monkeypatch.setattr(scheduler_stats, "_clock", lambda: later)
    stats = connector.get_kv_connector_stats()
    assert stats is not None
    assert stats.data["counters"] == {}
    gauges = summed_gauges(stats.data["gauges"])
    assert gauges["tier_blocks_in_use"] == 0
    assert "blocks_pending_store" in gauges
    assert connector.get_kv_connector_stats() is None  # sent: quiet again until the next


def test_a_gauge_only_change_is_reported() -> None:
    """A lookup pins tier blocks: no counter moves, but the in-use gauge must."""
    harness, _ = collect_stats()
    connector = harness.scheduler.connector
    assert connector.get_kv_connector_stats() is None
    assert harness.scheduler.reset_prefix_cache()
    harness.add_request("late", [*PROMPTS["req-0"], 7], max_tokens=3)
    assert connector.get_num_new_matched_tokens(harness.requests["late"], 0) == (48, True)
    stats = connector.get_kv_connector_stats()
    assert stats is not None
    assert stats.data["counters"] == {}
    assert summed_gauges(stats.data["gauges"])["tier_blocks_in_use"] == 3
    drain_collecting_stats(harness)


def test_a_counter_only_change_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts run again from the GPU prefix cache: their blocks' stores are skipped as
    already in the tier (store outcomes count), while no gauge moves (nothing pinned or
    pending). The counts go out though the gauges equal the last ones sent."""
    harness, before = collect_stats()
    now = scheduler_stats._clock()
    monkeypatch.setattr(scheduler_stats, "_clock", lambda: now)  # no heartbeat is due
    assert harness.scheduler.connector.get_kv_connector_stats() is None
    last_gauges = summed_gauges(before[-1]["gauges"])  # type: ignore[arg-type]
    for request_id, prompt in AGAIN.items():
        harness.add_request(f"{request_id}-2", prompt, max_tokens=3)
    payloads = drain_collecting_stats(harness)
    outcomes = {
        name: value
        for payload in payloads
        for name, value in payload["counters"].items()
        if name.startswith("store_outcome.")
    }
    assert outcomes, payloads
    assert all(summed_gauges(p["gauges"]) == last_gauges for p in payloads), payloads
