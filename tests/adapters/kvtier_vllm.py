"""Helpers for driving `KVTierConnector` inside the vLLM harness (test helper only).

Import after `pytest.importorskip("vllm")`. `kvtier_harness` builds a real vLLM scheduler
with the connector's scheduler role and one worker role per rank over the harness's
fake KV cache. `PollGate` sits between a rank's `OffloadWorker` and the connector: it
can hold completions back (transfers still "in flight") or turn loads into failures
that also scribble over the load's destination blocks, so a failed load that vLLM
served anyway trips the harness's fingerprint check.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from busy_steps import busy_steps
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm_harness import (
    ConnectorWorker,
    FakeKVCache,
    HarnessConfig,
    StepRecord,
    VllmHarness,
    connector_worker_factory,
)

from kvtier.adapters.vllm import KVTierConnector, scheduler_stats
from kvtier.adapters.vllm.scheduler_side import SchedulerSide
from kvtier.offload.plan import Tier, TransferPlan, WorkerReport
from kvtier.transfer.worker import OffloadWorker

CONNECTOR = "KVTierConnector"
MODULE = "kvtier.adapters.vllm"
# One block id of the harness model: 2 layers x 2048-byte pages.
SLOT_BYTES = 2 * 2048
# vLLM's scheduling as harness overrides: its plain `Scheduler`; the `AsyncScheduler`
# (0.33's default) in lock-step; and overlapped like its engine core, step N+1 scheduled
# before step N's output is processed.
SCHEDULING: dict[str, dict[str, Any]] = {
    "sync": {},
    "async": {"async_scheduling": True},
    "async_pipelined": {"async_scheduling": True, "batch_queue_size": 2},
}


def freeze_stats_clock(monkeypatch: Any) -> None:
    """Stop the clock of the stats heartbeat (`STATS_HEARTBEAT_S`, 5 s): a test expecting
    no stats between two calls would get the heartbeat's if 5 s of wall time passed
    between them (a loaded machine). A test may still set the clock itself."""
    monkeypatch.setattr(scheduler_stats, "_clock", lambda: 0.0)


def kvtier_config(num_cpu_blocks: int = 256, **overrides: Any) -> HarnessConfig:
    """Return a harness config running kvtier's connector with a CPU tier of that size.

    `extra` entries in `overrides` (a dict) are merged into `kv_connector_extra_config`.
    """
    extra = {"cpu_bytes": num_cpu_blocks * SLOT_BYTES, **overrides.pop("extra", {})}
    overrides.setdefault("kv_load_failure_policy", "recompute")
    return HarnessConfig(
        connector=CONNECTOR, connector_module=MODULE, extra_config=extra, **overrides
    )


def kvtier_harness(num_cpu_blocks: int = 256, **overrides: Any) -> VllmHarness:
    """Return a harness with kvtier's scheduler role and one worker role per rank."""
    return VllmHarness(kvtier_config(num_cpu_blocks, **overrides), connector_worker_factory)


def scheduler_side(harness: VllmHarness) -> SchedulerSide:
    """Return the connector's scheduler role translator (kvtier's child of a
    `MultiConnector` too)."""
    connector: Any = harness.scheduler.connector
    for child in getattr(connector, "sub_connectors", [connector]):
        if hasattr(child, "scheduler_side"):
            return child.scheduler_side  # type: ignore[no-any-return]
    raise AssertionError("no kvtier connector")


@contextlib.contextmanager
def lone_worker() -> Iterator[ConnectorWorker]:
    """Yield kvtier's worker role alone over a 16-block fake KV cache, driven call by call
    (no scheduler); shut it down, then its harness, on the way out."""
    harness = VllmHarness(kvtier_config(extra={"num_blocks": 16}))
    try:
        worker = ConnectorWorker.create(
            harness.vllm_config, harness.kv_cache_config, FakeKVCache(harness.kv_cache_config)
        )
        yield worker
        worker.connector.shutdown()
    finally:
        harness.close()


def kvtier_worker(harness: VllmHarness, rank: int = 0) -> ConnectorWorker:
    """Return one rank's worker side running kvtier's worker role (a `MultiConnector`
    worker side's child too: `multi_connector.MultiWorker`)."""
    worker = harness.workers[rank]
    for child in getattr(worker, "children", [worker]):
        if isinstance(child, ConnectorWorker) and hasattr(child.connector, "worker_side"):
            return child
    raise AssertionError("no kvtier worker")


def offload_worker(harness: VllmHarness, rank: int = 0) -> OffloadWorker:
    """Return the `OffloadWorker` of one rank."""
    return kvtier_worker(harness, rank).connector.worker_side.worker  # type: ignore[attr-defined,no-any-return]


def flush_before_polls(worker: OffloadWorker) -> None:
    """Make `worker` finish every copy before each poll: none is in flight between steps
    (vLLM's reset raises while any GPU block is referenced, and kvtier pins the blocks of
    stores in flight)."""
    poll = worker.poll

    def poll_after_flush() -> WorkerReport:
        worker.flush()
        return poll()

    worker.poll = poll_after_flush  # type: ignore[method-assign]


def num_resent(harness: VllmHarness) -> int:
    """Return how many outputs the ranks sent again because vLLM dropped them
    (`redelivery.Outbox`): none unless a test drops one."""
    return sum(
        kvtier_worker(harness, rank).connector.worker_side.outbox.num_resent  # type: ignore[attr-defined]
        for rank in range(harness.cfg.num_ranks)
    )


def drain(harness: VllmHarness, max_steps: int = 2000) -> None:
    """Step until vLLM is idle (finish-time stores included)."""
    harness.run(max_steps)


def drain_collecting_stats(harness: VllmHarness, max_steps: int = 2000) -> list[dict[str, Any]]:
    """Step until idle; return every step's connector stats payload vLLM produced."""
    payloads = []
    for record in busy_steps(harness, max_steps):
        for outputs in record.outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                payloads.append(stats.kv_connector_stats)
    return payloads


def store_outcomes(record: StepRecord) -> dict[str, int]:
    """Return one step's store outcomes (`stored`, `dropped_unhashed`, ...) by count, over
    the connector stats of every output of the step."""
    counts: dict[str, int] = {}
    for outputs in record.outputs.values():
        stats = outputs.scheduler_stats
        payload = None if stats is None else stats.kv_connector_stats
        if payload:
            for name, value in KVTierConnector.build_kv_connector_stats(payload).reduce().items():
                if name.startswith("store_outcome."):
                    outcome = name.removeprefix("store_outcome.")
                    counts[outcome] = counts.get(outcome, 0) + int(value)
    return counts


def zero_blocks(harness: VllmHarness, rank: int = 0) -> Callable[[tuple[int, ...]], None]:
    """Return a scribbler that zeroes GPU blocks of one rank's fake KV cache."""

    def scribble(block_ids: tuple[int, ...]) -> None:
        for tensor in harness.caches[rank].tensors.values():
            tensor[list(block_ids)] = 0

    return scribble


def check_quiescent(harness: VllmHarness) -> None:
    """Assert nothing leaked once idle: pins, tracked requests, GPU blocks, in-flight work."""
    side = scheduler_side(harness)
    side.offload.check_invariants()
    set_aside = side.offload.disk_set_aside  # disk slots of failed writes stay held
    held = set(set_aside.held()) if set_aside is not None else set()
    for name, tier in side.offload.index.pools.items():  # the disk tier too, in a cascade
        aside = held if name is Tier.DISK else set()
        refs = [tier.ref_count(b) for b in range(1, tier.num_blocks)]
        assert refs == [int(b in aside) for b in range(1, tier.num_blocks)], "tier pin leaked"
    assert side.num_tracked_requests == 0
    assert not side.offload.loads.allocated, "finished requests still held"
    assert not side.offload.loads.recompute_next, "failed-load marks leaked"
    assert not side.has_pending_stores()
    # An echo of a load never issued is forgotten once every rank reported it: kept,
    # every later plan would carry it again.
    assert not side._plans.echoes, "echoes of never-issued loads leaked"
    assert not side._plans.finished_loads.num_pending, "a load some rank never reported"
    pool = harness.scheduler.kv_cache_manager.block_pool
    held = {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt and not b.is_null}
    assert held == deferred_frees(harness), "GPU block leaked"
    for rank in range(harness.cfg.num_ranks):
        offload_worker(harness, rank).check_invariants()
        worker = kvtier_worker(harness, rank)
        assert worker.connector.worker_side.loads.is_idle(), "load tracker leaked"  # type: ignore[attr-defined]


def deferred_frees(harness: VllmHarness) -> dict[int, int]:
    """Return the GPU blocks vLLM has yet to return to its pool, with their reference
    counts: those of requests freed while a step that ran them was never processed
    (`Scheduler.deferred_frees`, fenced on its processed step count)."""
    held: dict[int, int] = {}
    for _, blocks in harness.scheduler.deferred_frees:
        for block in blocks:
            held[block.block_id] = held.get(block.block_id, 0) + 1
    return held


class PollGate:
    """Wrap one rank's `OffloadWorker.submit`/`poll` to delay or fail transfers.

    `hold(kind)` keeps finished events of that kind ("load" or "store") from being
    reported until `release()`; `fail_loads(scribble)` reports every later load as
    failed, calling `scribble(gpu_block_ids)` first (the copy may have half-landed).
    """

    def __init__(self, worker: OffloadWorker) -> None:
        self.worker = worker
        self._submit = worker.submit
        self._poll = worker.poll
        self._kinds: dict[int, str] = {}
        self._load_dsts: dict[int, tuple[int, ...]] = {}
        self._held_kinds: set[str] = set()
        self._held = WorkerReport()
        self._scribble: Callable[[tuple[int, ...]], None] | None = None
        self.num_failed_loads = 0
        worker.submit = self.submit  # type: ignore[method-assign]
        worker.poll = self.poll  # type: ignore[method-assign]

    def hold(self, kind: str) -> None:
        """Hold back completions of `kind` ("load" or "store")."""
        self._held_kinds.add(kind)

    def release(self) -> None:
        """Report everything held at the next poll, and stop holding."""
        self._held_kinds.clear()

    def fail_loads(self, scribble: Callable[[tuple[int, ...]], None]) -> None:
        """Turn every load finishing from now on into a failure."""
        self._scribble = scribble

    def stop_failing_loads(self) -> None:
        """Report the loads finishing from now on as they ran."""
        self._scribble = None

    def submit(self, plan: TransferPlan) -> None:
        for job in plan.jobs:
            self._kinds[job.event_id] = "load" if job.is_load else "store"
            if job.is_load:
                self._load_dsts[job.event_id] = job.dst_block_ids
        self._submit(plan)

    def poll(self) -> WorkerReport:
        report = WorkerReport.merge([self._held, self._poll()])
        done = dict(report.done)
        failed = dict(report.failed)
        if self._scribble is not None:
            for event_id in [e for e in done if self._kinds[e] == "load"]:
                self._scribble(self._load_dsts[event_id])
                failed[event_id] = done.pop(event_id)
                self.num_failed_loads += 1
        held_done = {e: n for e, n in done.items() if self._kinds[e] in self._held_kinds}
        held_failed = {e: n for e, n in failed.items() if self._kinds[e] in self._held_kinds}
        self._held = WorkerReport(held_done, held_failed)
        return WorkerReport(
            {e: n for e, n in done.items() if e not in held_done},
            {e: n for e, n in failed.items() if e not in held_failed},
        )


PROM_LABELS = {"model_name": "tiny", "engine": "0"}


def observed_metrics(harness: Any, payloads: Iterable[Any]) -> tuple[CollectorRegistry, Any]:
    """Return a fresh registry holding kvtier's Prometheus metrics for engine 0 (labels
    `PROM_LABELS`) and those metrics, with every stats payload of `payloads` observed."""
    registry = CollectorRegistry()
    metric_types = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    metrics = KVTierConnector.build_prom_metrics(
        harness.vllm_config, metric_types, list(PROM_LABELS), {0: list(PROM_LABELS.values())}
    )
    for payload in payloads:
        metrics.observe(payload, engine_idx=0)
    return registry, metrics
