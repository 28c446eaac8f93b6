"""The vLLM test harness drives vLLM's real scheduler on CPU (needs the vLLM venv)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm_engine import PrefixFingerprints
from vllm_harness import (
    SIMPLE_CPU_OFFLOAD,
    FakeKVCache,
    FakeSimpleOffloadWorker,
    HarnessConfig,
    KVMismatchError,
    VllmHarness,
    connector_worker_factory,
    flatten_events,
    shared_prefix_prompts,
    simple_offload_worker_factory,
    timed,
)

# Per-layer page of the default geometry: 2 heads x 16 tokens x (16 + 16) x 2 bytes.
PAGE_BYTES = 2048


def make_simple_offload(
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 256,
    load_delay: int = 0,
    store_delay: int = 0,
    kv_cache_layout: str = "LBNHC",
) -> VllmHarness:
    cfg = HarnessConfig(
        connector=SIMPLE_CPU_OFFLOAD,
        num_gpu_blocks=num_gpu_blocks,
        kv_cache_layout=kv_cache_layout,
        # two layers per block
        extra_config={"cpu_bytes_to_use": num_cpu_blocks * 2 * PAGE_BYTES},
    )
    return VllmHarness(cfg, simple_offload_worker_factory(load_delay, store_delay))


def test_no_connector_shared_prefix_finishes_with_local_hits() -> None:
    harness, seconds = timed(lambda: VllmHarness(HarnessConfig()))
    print(f"scheduler built in {seconds:.2f} s")
    prompts = shared_prefix_prompts(8, prefix_len=64, suffix_len=10)
    harness.add_request("warm", prompts["req-0"], max_tokens=2)
    harness.run()
    num_steps = harness.run_requests(prompts, max_tokens=4)
    assert harness.finished == {"warm", *prompts}
    assert 0 < num_steps < 50
    assert all(harness.local_hit_tokens(r) == 64 for r in prompts if r != "req-0")
    assert all(harness.external_hit_tokens(r) == 0 for r in prompts)


# vLLM's plain Scheduler; its AsyncScheduler in lock-step; and overlapped (batch queue of 2).
SCHEDULING = {
    "sync": HarnessConfig(),
    "async": HarnessConfig(async_scheduling=True),
    "async_pipelined": HarnessConfig(async_scheduling=True, batch_queue_size=2),
}


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_fake_kv_cache_detects_wrong_contents(scheduling: str) -> None:
    harness = VllmHarness(SCHEDULING[scheduling])
    prompt = list(range(1000, 1040))
    harness.run_requests({"a": prompt}, max_tokens=1)
    for tensor in harness.caches[0].tensors.values():
        tensor.zero_()  # the GPU cache still claims the prefix, its bytes are gone
    harness.add_request("b", [*prompt, 7], max_tokens=1)
    with pytest.raises(KVMismatchError):
        harness.run()


@pytest.mark.parametrize("kv_cache_layout", ["LBNHC", "BLNHC"])
def test_simple_offload_reports_external_hits_after_gpu_reset(kv_cache_layout: str) -> None:
    harness = make_simple_offload(kv_cache_layout=kv_cache_layout)
    assert harness.scheduler.connector.scheduler_manager.num_cpu_blocks == 256
    prompts = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
    harness.run_requests(prompts, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()  # drop the GPU copies only
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=3)
    assert harness.finished == {*prompts, *again}
    # 48 + 5 prompt tokens + 2 decoded tokens stored as 3 full blocks of 16.
    assert all(harness.external_hit_tokens(r) == 48 for r in again)
    assert all(harness.local_hit_tokens(r) == 0 for r in again)
    assert harness.workers[0].num_loaded_blocks == 4 * 3


@pytest.mark.parametrize(("load_delay", "store_delay"), [(0, 0), (2, 2), (0, 3)])
def test_simple_offload_under_gpu_pressure(load_delay: int, store_delay: int) -> None:
    harness = make_simple_offload(num_gpu_blocks=40, load_delay=load_delay, store_delay=store_delay)
    # 12 prefixes of 4 blocks: more than the GPU keeps, so the second wave misses there.
    prompts = list(shared_prefix_prompts(36, prefix_len=64, suffix_len=8, num_prefixes=12).items())
    num_steps = 0
    for wave in range(3):
        num_steps += harness.run_requests(dict(prompts[wave * 12 : (wave + 1) * 12]))
    assert harness.finished == {r for r, _ in prompts}
    external = sum(harness.external_hit_tokens(r) for r, _ in prompts[12:])
    assert external > 0, "GPU pressure should force some CPU hits"
    assert all(harness.external_hit_tokens(r) % 16 == 0 for r, _ in prompts)
    print(f"{num_steps} steps, external hit tokens {external}")
    assert not harness.scheduler.connector.has_pending_push_work()


def test_connector_worker_calls_in_model_runner_order() -> None:
    cfg = HarnessConfig(connector="RecordingConnector", connector_module="recording_connector")
    harness = VllmHarness(cfg, connector_worker_factory)
    connector = harness.workers[0].connector
    assert set(connector.registered) == set(cfg.layer_names)
    one_step = [
        "handle_preemptions",
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "build_connector_worker_meta",
        "clear_connector_metadata",
    ]
    harness.step()  # an empty step still runs the connector's whole step
    assert connector.calls == one_step
    harness.run_requests({"a": list(range(1000, 1020))}, max_tokens=2)
    assert connector.calls == one_step * harness.num_steps


def test_simple_offload_with_two_ranks_waits_for_both() -> None:
    store_delays = iter([0, 3])  # rank 1 finishes its stores three steps after rank 0

    def factory(harness: VllmHarness, cache: FakeKVCache) -> FakeSimpleOffloadWorker:
        manager = harness.scheduler.connector.scheduler_manager
        return FakeSimpleOffloadWorker(cache, manager.num_cpu_blocks, 0, next(store_delays))

    cfg = HarnessConfig(
        connector=SIMPLE_CPU_OFFLOAD,
        num_ranks=2,
        extra_config={"cpu_bytes_to_use": 2 * 256 * 2 * PAGE_BYTES},  # 256 blocks a rank
    )
    harness = VllmHarness(cfg, factory)
    assert harness.scheduler.connector.scheduler_manager.num_cpu_blocks == 256
    prompts = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
    harness.run_requests(prompts, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=3)  # both ranks' caches are checked
    assert all(harness.external_hit_tokens(r) == 48 for r in again)
    assert [w.num_loaded_blocks for w in harness.workers] == [12, 12]


def test_kv_events_are_captured_per_step() -> None:
    cfg = HarnessConfig(
        connector=SIMPLE_CPU_OFFLOAD,
        enable_kv_events=True,
        extra_config={"cpu_bytes_to_use": 64 * 2 * PAGE_BYTES},
    )
    harness = VllmHarness(cfg, simple_offload_worker_factory())
    harness.run_requests({"a": list(range(1000, 1040))}, max_tokens=2)
    stored = [e for e in flatten_events(harness.event_batches) if type(e).__name__ == "BlockStored"]
    assert {e.medium for e in stored} == {"GPU", "CPU"}
    assert sum(e.medium == "CPU" for e in stored) == 2  # 41 computed tokens: 2 full blocks


def record_placeholders(harness: VllmHarness) -> list[int]:
    """Return a list that gets, after each schedule, the most placeholders of a request."""
    schedule = harness.scheduler.schedule
    placeholders: list[int] = []

    def recording_schedule() -> SchedulerOutput:
        output = schedule()
        requests = harness.scheduler.requests.values()
        placeholders.append(max((r.num_output_placeholders for r in requests), default=0))
        return output

    harness.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return placeholders


def test_async_scheduling_overlaps_steps_and_samples_the_same_tokens() -> None:
    prompts = shared_prefix_prompts(6, prefix_len=32, suffix_len=7, num_prefixes=2)
    outputs = {}
    for name, cfg in SCHEDULING.items():
        harness = VllmHarness(cfg)
        assert isinstance(harness.scheduler, AsyncScheduler) == cfg.async_scheduling
        placeholders = record_placeholders(harness)
        harness.run_requests(prompts, max_tokens=6)
        assert harness.finished == set(prompts)
        outputs[name] = {r: list(harness.requests[r].output_token_ids) for r in prompts}
        # Lock-step: one placeholder (this step's sample) at most; overlapped: a step is
        # scheduled while the previous step's token is still a placeholder.
        assert max(placeholders) == {"sync": 0, "async": 1, "async_pipelined": 2}[name]
    assert outputs["async"] == outputs["sync"] == outputs["async_pipelined"]


def test_overlapping_steps_need_async_scheduling() -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        HarnessConfig(batch_queue_size=2)


def test_a_delivered_token_other_than_the_sampled_one_is_caught() -> None:
    fingerprints = PrefixFingerprints()
    request = SimpleNamespace(
        request_id="a", all_token_ids=[5, 6], lora_request=None, cache_salt=None
    )
    sampled = fingerprints.upto(request, 3, token_at=lambda pos: 7)  # type: ignore[arg-type]
    request.all_token_ids.append(7)
    assert fingerprints.upto(request, 3) == sampled  # type: ignore[arg-type]
    fingerprints.upto(request, 4, token_at=lambda pos: 8)  # type: ignore[arg-type]
    request.all_token_ids.append(9)
    with pytest.raises(AssertionError, match="position 3 delivered another token"):
        fingerprints.upto(request, 4)  # type: ignore[arg-type]
