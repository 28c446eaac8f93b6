"""The CPU+disk cascade through `KVTierConnector`, inside vLLM's real scheduler.

The CPU tier is small and the disk tier (page-cache I/O in a temporary directory) large,
so prefixes evicted from vLLM's GPU cache and from the CPU tier are served from disk.
The harness checks every position vLLM treats as computed (`KVMismatchError`), so a
load reported finished before all its parts landed, or served after a failure, fails.
"""

from __future__ import annotations

import collections
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from kvtier_vllm import (
    PROM_LABELS,
    SCHEDULING,
    SLOT_BYTES,
    check_quiescent,
    kvtier_harness,
    observed_metrics,
    offload_worker,
    scheduler_side,
)
from vllm.distributed.kv_events import BlockStored
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm_harness import StepRecord, VllmHarness, flatten_events, shared_prefix_prompts

from kvtier.offload.plan import Tier, TransferPlan, WorkerReport
from kvtier.transfer.worker import OffloadWorker

MODES = ["write_through", "write_back"]


def cascade_harness(
    tmp_path: Path, mode: str, num_cpu_blocks: int, **overrides: Any
) -> VllmHarness:
    extra = {
        "disk_bytes": 256 * SLOT_BYTES,
        "disk_path": str(tmp_path),
        "disk_io_mode": "page_cache",
        "cascade": mode,
    }
    return kvtier_harness(num_cpu_blocks=num_cpu_blocks, extra=extra, **overrides)


class Observed:
    """What the steps of a run showed: vLLM's hit sources, kvtier's stats, split loads."""

    def __init__(self) -> None:
        self.hits_by_source: collections.Counter[CacheHitSource] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.split_requests: set[str] = set()
        self.payloads: list[dict[str, Any]] = []
        self.connector_hits = 0  # every admission's external tokens, preempted ones too

    def add(self, record: StepRecord) -> None:
        plan = record.scheduler_output.kv_connector_metadata.plan  # type: ignore[union-attr]
        events = collections.Counter(
            request_id
            for job in plan.jobs
            if job.is_load
            for request_id in plan.load_request_ids[job.event_id]
        )
        self.split_requests |= {r for r, n in events.items() if n > 1}
        for outputs in record.outputs.values():
            stats = outputs.scheduler_stats
            if stats is None:
                continue
            connector = stats.connector_prefix_cache_stats
            if connector is not None:
                self.hits_by_source.update(connector.hits_by_source)
                self.connector_hits += connector.hits + connector.preempted_hits
            if stats.kv_connector_stats is not None:
                self.counters.update(stats.kv_connector_stats["counters"])
                self.payloads.append(stats.kv_connector_stats)

    def run(self, harness: VllmHarness, prompts: dict[str, list[int]], wave: int) -> None:
        items = list(prompts.items())
        for start in range(0, len(items), wave):
            for request_id, prompt in items[start : start + wave]:
                harness.add_request(request_id, prompt, max_tokens=4)
            for record in busy_steps(harness):
                self.add(record)


@pytest.mark.parametrize("scheduling", ["sync", "async_pipelined"])
@pytest.mark.parametrize("mode", MODES)
def test_prefixes_evicted_from_gpu_and_cpu_are_served_from_disk(
    mode: str, scheduling: str, tmp_path: Path
) -> None:
    # 12 prefixes of 4 blocks over 3 waves: neither the 40-block GPU pool nor the 32-slot
    # CPU tier keeps them all; the 256-slot disk tier does. Also with vLLM's overlapped
    # asynchronous scheduling (step N+1 scheduled before step N's output).
    harness = cascade_harness(
        tmp_path, mode, num_cpu_blocks=33, num_gpu_blocks=40, **SCHEDULING[scheduling]
    )
    side = scheduler_side(harness)
    assert side.tier_sizes == {Tier.CPU: 33, Tier.DISK: 256}
    assert side.offload.cascade is not None
    config = offload_worker(harness).config
    assert (config.cpu_num_slots, config.disk_num_slots) == (33, 256)
    assert [p.name for p in tmp_path.iterdir()] == ["kvtier-rank0.slots"]

    prompts = shared_prefix_prompts(36, prefix_len=64, suffix_len=8, num_prefixes=12)
    observed = Observed()
    observed.run(harness, prompts, wave=12)

    assert harness.finished == set(prompts)
    external = sum(harness.external_hit_tokens(r) for r in prompts)
    hit_tokens = side.offload.take_stats().hit_tokens  # re-admissions count again
    assert hit_tokens["DISK"] > 0, "evicted prefixes should come back from disk"
    assert external > 0
    assert sum(hit_tokens.values()) == observed.connector_hits
    assert observed.counters["hit_tokens"] == sum(hit_tokens.values())
    assert observed.counters["tier_hit_tokens.DISK"] == hit_tokens["DISK"]
    assert observed.counters["tier_hit_tokens.CPU"] == hit_tokens["CPU"]
    assert observed.counters["demoted_blocks"] > 0
    assert observed.counters["promoted_blocks"] > 0  # disk hits stored into the CPU tier again
    # vLLM's per-source hits (first admissions) follow the tier that served each block.
    by_source = observed.hits_by_source
    assert set(by_source) <= {CacheHitSource.HOST, CacheHitSource.DISK}
    assert 0 < by_source[CacheHitSource.DISK] <= hit_tokens["DISK"]
    assert by_source[CacheHitSource.HOST] <= hit_tokens["CPU"]
    assert_prometheus(harness, observed, mode, hit_tokens["DISK"])
    check_quiescent(harness)


def assert_prometheus(harness: VllmHarness, observed: Observed, mode: str, disk_hits: int) -> None:
    registry, _ = observed_metrics(harness, observed.payloads)
    labels = PROM_LABELS
    value = registry.get_sample_value
    assert value("kvtier:tier_hit_tokens_total", {**labels, "tier": "DISK"}) == disk_hits
    assert value("kvtier:demoted_blocks_total", labels) == observed.counters["demoted_blocks"]
    info = {
        "tier": "CPU",
        "store_mode": "eager",
        "num_tier_blocks": "33",
        "disk_io_mode": "page_cache",
        "cascade": mode,
        "num_disk_blocks": "256",
    }
    assert value("kvtier:info", {**labels, **info}) == 1


class DeferDiskLoads:
    """Wrap an `OffloadWorker` so a DISK → GPU job starts only `polls` polls after every
    other load was reported, and optionally fails (after scribbling over its blocks).

    The CPU part of a split load is then reported steps before the disk part lands: a
    request reported finished on its first part would be scheduled onto missing KV.
    """

    def __init__(self, worker: OffloadWorker, polls: int, scribble: Any = None) -> None:
        self._submit = worker.submit
        self._poll = worker.poll
        self._polls = polls
        self._scribble = scribble
        self._deferred: list[list[Any]] = []  # [polls left, plan]
        self._other_loads: set[int] = set()
        self._failing: dict[int, tuple[int, ...]] = {}
        self.num_deferred = 0
        worker.submit = self.submit  # type: ignore[method-assign]
        worker.poll = self.poll  # type: ignore[method-assign]

    def submit(self, plan: TransferPlan) -> None:
        disk = tuple(j for j in plan.jobs if j.is_load and j.src_tier is Tier.DISK)
        rest = tuple(j for j in plan.jobs if j not in disk)
        self._other_loads.update(j.event_id for j in rest if j.is_load)
        if disk:
            self._deferred.append([self._polls, replace(plan, jobs=disk)])
            self.num_deferred += len(disk)
            if self._scribble is not None:
                self._failing.update({j.event_id: j.dst_block_ids for j in disk})
        if rest:
            self._submit(replace(plan, jobs=rest))

    def poll(self) -> WorkerReport:
        report = self._poll()
        self._other_loads.difference_update(report.done, report.failed)
        if not self._other_loads:
            for item in list(self._deferred):
                item[0] -= 1
                if item[0] < 0:
                    self._deferred.remove(item)
                    self._submit(item[1])
        failing = [e for e in report.done if e in self._failing]
        if not failing:
            return report
        done = dict(report.done)
        failed = dict(report.failed)
        for event_id in failing:
            self._scribble(self._failing.pop(event_id))
            failed[event_id] = done.pop(event_id)
        return WorkerReport(done, failed)


@pytest.mark.parametrize("fail_disk_part", [False, True])
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_load_split_over_cpu_and_disk_finishes_when_both_parts_landed(
    num_ranks: int, fail_disk_part: bool, tmp_path: Path
) -> None:
    # 6 CPU slots, write-through: P1's 4 blocks go to CPU and disk; P2's 4 blocks then
    # evict P1's tail (blocks 2, 3) from the CPU tier, so P1 comes back half from each.
    # With two ranks (each with its own CPU tier and disk file) only the last rank holds
    # its disk part back (and fails it): vLLM's aggregation of the ranks' reports and
    # kvtier's per-part completion must both wait for it.
    harness = cascade_harness(tmp_path, "write_through", num_cpu_blocks=7, num_ranks=num_ranks)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"kvtier-rank{rank}.slots" for rank in range(num_ranks)
    ]
    prompts = shared_prefix_prompts(2, prefix_len=64, suffix_len=8, num_prefixes=2)
    for request_id, prompt in prompts.items():
        harness.run_requests({request_id: prompt}, max_tokens=4)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    for cache in harness.caches:
        cache.raw.zero_()  # no stale copy of P1 left in the GPU blocks
    last = num_ranks - 1

    def scribble(block_ids: tuple[int, ...]) -> None:
        for tensor in harness.caches[last].tensors.values():
            tensor[list(block_ids)] = 0

    gate = DeferDiskLoads(
        offload_worker(harness, rank=last),
        polls=3,
        scribble=scribble if fail_disk_part else None,
    )
    observed = Observed()
    observed.run(harness, {"again": [*prompts["req-0"], 9]}, wave=1)

    assert "again" in harness.finished
    assert gate.num_deferred == 1
    assert observed.split_requests == {"again"}
    assert harness.external_hit_tokens("again") == 64
    # After the failure vLLM recomputes the whole prefix: kvtier offers a request whose
    # load failed no hit again (not even the CPU half), and the harness checked every
    # loaded position.
    assert dict(observed.hits_by_source) == {CacheHitSource.HOST: 32, CacheHitSource.DISK: 32}
    assert observed.counters["failed_loads"] == (1 if fail_disk_part else 0)
    check_quiescent(harness)


def test_cascade_events_carry_both_media(tmp_path: Path) -> None:
    """Scenario 29 through vLLM: CPU and STORAGE media, each event one whole block."""
    harness = cascade_harness(tmp_path, "write_back", num_cpu_blocks=7, enable_kv_events=True)
    prompts = shared_prefix_prompts(4, prefix_len=64, suffix_len=8, num_prefixes=4)
    for request_id, prompt in prompts.items():
        harness.run_requests({request_id: prompt}, max_tokens=4)
    events = flatten_events(harness.event_batches)
    media = {e.medium for e in events if isinstance(e, BlockStored)}
    assert media == {"GPU", "CPU", "STORAGE"}
    # Every medium counts a block's own tokens (vLLM records a key's prefix tokens).
    assert {e.block_size for e in events if isinstance(e, BlockStored)} == {16}
    check_quiescent(harness)
