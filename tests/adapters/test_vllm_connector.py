"""`KVTierConnector` inside vLLM's real scheduler, with its worker role on CPU tensors.

Every step the harness checks, for each request it (re)schedules, that the positions
vLLM treats as computed hold that request's prefix (`KVMismatchError` otherwise), so a
wrong load, a load into the wrong block or a load that never happened fails the test.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from kvtier_vllm import (
    CONNECTOR,
    MODULE,
    SCHEDULING,
    PollGate,
    check_quiescent,
    drain,
    flush_before_polls,
    kvtier_config,
    kvtier_harness,
    offload_worker,
    scheduler_side,
)
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm_harness import HarnessConfig, VllmHarness, shared_prefix_prompts

from kvtier.adapters.vllm import KVTierConnector, worker_side
from kvtier.adapters.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.offload.config import ConfigError
from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport


def run_waves(
    harness: VllmHarness,
    prompts: dict[str, list[int]],
    wave: int,
    hits: list[int] | None = None,
    **kw: int,
) -> int:
    """Run `prompts` in waves of `wave` requests; return the preemptions seen.

    `hits` (if given) receives vLLM's external hit tokens of every admission, preempted
    requests' re-admissions included.
    """
    items = list(prompts.items())
    num_preempted = 0
    for start in range(0, len(items), wave):
        for request_id, prompt in items[start : start + wave]:
            harness.add_request(request_id, prompt, **kw)
        for record in busy_steps(harness):
            num_preempted += len(record.scheduler_output.preempted_req_ids or ())
            for outputs in record.outputs.values():
                stats = outputs.scheduler_stats
                connector = stats.connector_prefix_cache_stats if stats else None
                if hits is not None and connector is not None:
                    hits.append(connector.hits + connector.preempted_hits)
    return num_preempted


def test_connector_loads_through_vllms_factory() -> None:
    harness = kvtier_harness()
    connector = harness.scheduler.connector
    assert isinstance(connector, KVTierConnector)
    assert isinstance(connector, SupportsHMA)
    assert not connector.requires_kv_delivery
    assert scheduler_side(harness).num_tier_blocks == 256
    assert offload_worker(harness).config.cpu_num_slots == 256
    assert offload_worker(harness).bytes_per_slot == 2 * 2048


def test_metadata_survives_pickling_between_processes() -> None:
    harness = kvtier_harness()
    harness.add_request("a", list(range(1000, 1100)), max_tokens=2)
    metadata = harness.step().scheduler_output.kv_connector_metadata
    assert pickle.loads(pickle.dumps(metadata)) == metadata
    drain(harness)
    report = WorkerReport(done={3: 1}, failed={4: 1}, bad_blocks={4: frozenset({7})})
    merged = KVTierWorkerMetadata(report).aggregate(KVTierWorkerMetadata(report))
    expected = WorkerReport({3: 2}, {4: 2}, bad_blocks={4: frozenset({7})})
    assert pickle.loads(pickle.dumps(merged)).report == expected
    load = TransferJob(5, Tier.DISK, Tier.GPU, (7, 8, 9), (1, 2, 3), load_parts=(1, 2))
    plan = KVTierMetadata(TransferPlan(9, (load,), {5: ("a", "b")}), ("c",))
    assert pickle.loads(pickle.dumps(plan)) == plan
    stats = KVTierConnector.build_kv_connector_stats({"counters": {"transfer_bytes.load": 8}})
    assert pickle.loads(pickle.dumps(stats)).data == stats.data


def test_aggregated_metadata_keeps_the_later_failed_forward_step() -> None:
    """Ranks whose forwards failed in different steps: the scheduler role must learn the
    later one at once, or every rank failing there fails the stores of the plans built
    meanwhile (and its report comes back to say it again)."""
    early, late, none = (KVTierWorkerMetadata(failed_forward_step=s) for s in (3, 5, None))
    for a, b in ((early, late), (late, early), (early, none), (none, late)):
        expected = max(s for s in (a.failed_forward_step, b.failed_forward_step) if s)
        assert a.aggregate(b).failed_forward_step == expected
    assert none.aggregate(none).failed_forward_step is None


def test_aggregating_another_connector_s_worker_metadata_is_refused() -> None:
    class Other(KVConnectorWorkerMetadata):
        def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
            return self

    with pytest.raises(TypeError, match="cannot aggregate KVTierWorkerMetadata with Other"):
        KVTierWorkerMetadata().aggregate(Other())


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_evicted_shared_prefixes_are_served_from_the_tier(store_mode: str, scheduling: str) -> None:
    # 12 prefixes of 4 blocks over 3 waves: a 40-block GPU pool cannot keep them.
    harness = kvtier_harness(
        num_gpu_blocks=40, extra={"store_mode": store_mode}, **SCHEDULING[scheduling]
    )
    prompts = shared_prefix_prompts(36, prefix_len=64, suffix_len=8, num_prefixes=12)
    hits: list[int] = []
    run_waves(harness, prompts, wave=12, hits=hits)
    assert harness.finished == set(prompts)
    later = list(prompts)[12:]
    external = sum(harness.external_hit_tokens(r) for r in later)
    assert external > 0, "the second and third waves should hit the tier"
    assert all(harness.external_hit_tokens(r) % 16 == 0 for r in prompts)
    # Every admission's hit (a preempted request's re-admission too; the harness's
    # `external_hit_tokens` is vLLM's first attempt only, which may not have been admitted).
    totals = scheduler_side(harness).offload.take_stats()
    assert totals.hit_tokens == {"CPU": sum(hits)}
    check_quiescent(harness)


def test_the_token_check_serves_vllms_hits_and_counts_no_mismatch() -> None:
    """`token_check` (SPEC §3 Beyond) with vLLM's own hashes, tokens and extra keys."""
    harness = kvtier_harness(num_gpu_blocks=40, extra={"token_check": True})
    prompts = shared_prefix_prompts(36, prefix_len=64, suffix_len=8, num_prefixes=12)
    run_waves(harness, prompts, wave=12)
    assert harness.finished == set(prompts)
    assert sum(harness.external_hit_tokens(r) for r in list(prompts)[12:]) > 0
    offload = scheduler_side(harness).offload
    assert offload.tags is not None
    assert len(offload.tags) == 0, "every finished request's tags are dropped"
    assert offload.take_stats().num_tag_mismatches == 0
    check_quiescent(harness)


@pytest.mark.parametrize("kv_cache_layout", ["LBNHC", "BLNHC"])
def test_gpu_prefix_cache_reset_is_served_entirely_from_the_tier(kv_cache_layout: str) -> None:
    harness = kvtier_harness(kv_cache_layout=kv_cache_layout)
    prompts = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
    harness.run_requests(prompts, max_tokens=3)  # idle only once finish-time stores landed
    assert harness.scheduler.reset_prefix_cache()  # the GPU copies only
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=3)
    # 53 prompt tokens + 2 decoded: 3 full blocks stored, all 48 prefix tokens loaded.
    assert all(harness.external_hit_tokens(r) == 48 for r in again)
    assert all(harness.local_hit_tokens(r) == 0 for r in again)
    check_quiescent(harness)


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_preemption_flushes_and_resumed_requests_stay_correct(
    store_mode: str, scheduling: str
) -> None:
    # 8 concurrent requests decoding 48 tokens each overflow a 30-block pool.
    harness = kvtier_harness(
        num_gpu_blocks=30,
        max_num_seqs=8,
        extra={"store_mode": store_mode},
        **SCHEDULING[scheduling],
    )
    prompts = shared_prefix_prompts(16, prefix_len=64, suffix_len=24, num_prefixes=4)
    num_preempted = run_waves(harness, prompts, wave=8, max_tokens=48)
    assert num_preempted > 0
    assert harness.finished == set(prompts)
    check_quiescent(harness)


def test_reset_with_running_requests_preempts_them_and_they_finish() -> None:
    harness = kvtier_harness()
    flush_before_polls(offload_worker(harness))  # no copy in flight at a reset
    prompts = shared_prefix_prompts(6, prefix_len=64, suffix_len=24, num_prefixes=2)
    for request_id, prompt in prompts.items():
        harness.add_request(request_id, prompt, max_tokens=16)
    for _ in range(4):
        harness.step()
    running = {r.request_id for r in harness.scheduler.running}
    assert running
    assert harness.scheduler.reset_prefix_cache(reset_running_requests=True)
    record = harness.step()  # preempted since the last step, resumed in this one
    assert running <= set(record.scheduler_output.preempted_req_ids or ())
    drain(harness)
    assert harness.finished == set(prompts)
    check_quiescent(harness)


def test_two_ranks_complete_stores_only_when_both_copied() -> None:
    harness = kvtier_harness(num_ranks=2)
    gate = PollGate(offload_worker(harness, 1))
    gate.hold("store")
    prompts = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
    for request_id, prompt in prompts.items():
        harness.add_request(request_id, prompt, max_tokens=3)
    for _ in range(30):
        harness.step()
    side = scheduler_side(harness)
    assert harness.finished == set(prompts)
    assert side.has_pending_stores(), "rank 1 has not reported its stores"
    tier = side.offload.tier_pool
    assert not any(tier.is_cached(b) for b in range(1, tier.num_blocks)), "registered too early"
    gate.release()
    drain(harness)
    assert side.offload.take_stats().num_tier_blocks_in_use == 0
    assert harness.scheduler.reset_prefix_cache()
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=3)  # both ranks' caches are checked
    assert all(harness.external_hit_tokens(r) == 48 for r in again)
    check_quiescent(harness)


def test_no_hit_for_requests_that_skip_the_prefix_cache() -> None:
    harness = kvtier_harness()
    prompt = shared_prefix_prompts(1, prefix_len=48, suffix_len=5)["req-0"]
    harness.run_requests({"a": prompt}, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()
    harness.add_request("b", [*prompt, 9], max_tokens=1, prompt_logprobs=1)
    drain(harness)
    assert (harness.local_hit_tokens("b"), harness.external_hit_tokens("b")) == (0, 0)
    assert harness.scheduler.reset_prefix_cache()
    harness.run_requests({"c": [*prompt, 9]}, max_tokens=1)
    assert harness.external_hit_tokens("c") == 48
    check_quiescent(harness)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes": 1 << 20, "bogus_key": 1}, "bogus_key"),
        ({"cpu_bytes": 1 << 20, "cascade": True}, "cascade"),
        ({"cpu_bytes": 1 << 20, "policy": "mru"}, "policy='mru' is invalid"),
        ({"cpu_bytes": 1 << 20, "cascade": "write_around"}, "write_around"),
        (
            {
                "cpu_bytes": 1 << 20,
                "disk_bytes": 1 << 20,
                "disk_path": "/tmp",
                "disk_persist": True,
            },
            "disk_persist",
        ),
        ({"cpu_bytes": 4096}, "at least 2"),
        ({"cpu_bytes": 1 << 20, "token_check": True, "store_mode": "lazy"}, "token_check"),
    ],
)
def test_bad_config_fails_at_start_up(extra: dict[str, object], message: str) -> None:
    cfg = HarnessConfig(connector=CONNECTOR, connector_module=MODULE, extra_config=extra)
    with pytest.raises(ConfigError, match=message):
        VllmHarness(cfg)


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_a_kv_role_other_than_kv_both_fails_at_start_up(kv_role: str) -> None:
    """With kv_producer vLLM frees blocks an overlapped step may still write, where a
    load could fill them early: kvtier loads, so it runs only as kv_both."""
    cfg = HarnessConfig(
        connector=CONNECTOR,
        connector_module=MODULE,
        extra_config={"cpu_bytes": 1 << 20},
        kv_role=kv_role,
    )
    with pytest.raises(ValueError, match=f"kv_role must be 'kv_both', got '{kv_role}'"):
        VllmHarness(cfg)


def test_direct_io_with_unaligned_blocks_fails_at_start_up(tmp_path: Path) -> None:
    # 3 layers of 2048-byte pages: a block id spans 6144 B, not whole 4096-byte pages.
    disk = {"cpu_bytes": 0, "disk_bytes": 1 << 22, "disk_path": str(tmp_path)}
    with pytest.raises(ConfigError, match='"disk_io_mode": "page_cache"'):
        VllmHarness(kvtier_config(num_layers=3, extra=disk))  # the scheduler role
    page_cache = kvtier_config(num_layers=3, extra={**disk, "disk_io_mode": "page_cache"})
    assert scheduler_side(VllmHarness(page_cache)).tier_sizes == {Tier.DISK: (1 << 22) // 6144}


@pytest.mark.parametrize("problem", ["missing", "a file"])
def test_a_bad_disk_path_fails_when_the_worker_role_starts(problem: str, tmp_path: Path) -> None:
    path = tmp_path / "no" / "dir"
    if problem == "a file":
        path = tmp_path / "file"
        path.touch()
    extra = {"cpu_bytes": 0, "disk_bytes": 1 << 22, "disk_path": str(path)}
    harness = VllmHarness(kvtier_config(extra=extra))  # the scheduler holds no tier
    with pytest.raises(ConfigError, match=f"disk_path={str(path)!r}"):
        KVConnectorFactory.create_connector(
            harness.vllm_config, KVConnectorRole.WORKER, harness.kv_cache_config
        )  # before any tier is allocated


def test_tier_file_rank_is_the_global_rank_or_the_device_index() -> None:
    # Outside vLLM's distributed state (this process) the device index names the file.
    assert worker_side.distributed_rank() is None
    assert worker_side.file_rank(None) == 0
    assert worker_side.file_rank(3) == 3
    # Inside it: vLLM's global rank (data parallelism folded in), whatever the device.
    for rank in range(8):
        world = SimpleNamespace(rank=rank, world_size=8)
        with mock.patch.object(parallel_state, "get_world_group", return_value=world):
            assert worker_side.distributed_rank() == rank
            assert worker_side.file_rank(0) == rank


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_vllm_defers_freeing_blocks_a_queued_step_may_write(scheduling: str) -> None:
    """kvtier's loads do not wait for compute (`kvtier.transfer.worker`): under overlapping
    steps vLLM must hold a finished request's blocks until the steps that may write them
    completed, so that no load is handed a block a queued forward still writes."""
    harness = VllmHarness(kvtier_config(**SCHEDULING[scheduling]))
    overlapping = harness.vllm_config.max_concurrent_batches > 1
    assert overlapping == (scheduling != "sync")
    assert harness.scheduler.defer_block_free is overlapping
    harness.close()
