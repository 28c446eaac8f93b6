"""Worker sides for the test harness: what runs on each rank around the fake forward.

Test helper only (see `vllm_harness`). A worker side is anything with
`before_forward(scheduler_output)` and `after_forward(scheduler_output)`, the latter
returning the rank's `KVConnectorOutput`. `ConnectorWorker` runs a real worker-role
connector in the model runner's call order; `FakeSimpleOffloadWorker` stands in for
vLLM's SimpleCPUOffload worker, whose copies need CUDA streams.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from unittest import mock

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm_engine import FakeKVCache

from kvtier.adapters.vllm import worker_side

if TYPE_CHECKING:
    from vllm_harness import VllmHarness


class WorkerSide(Protocol):
    """One rank's worker side of a KV connector, driven around the fake forward."""

    def before_forward(self, scheduler_output: SchedulerOutput) -> None: ...

    def after_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None: ...


WorkerFactory = Callable[["VllmHarness", FakeKVCache], "WorkerSide"]


class NoWorker:
    """A worker side that does nothing (no connector, or scheduler-only tests)."""

    def before_forward(self, scheduler_output: SchedulerOutput) -> None:
        """Do nothing."""

    def after_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        """Report nothing."""
        return None


class ConnectorWorker:
    """A real worker-role connector, called in the order vLLM's model runner calls it.

    Before the forward: `handle_preemptions`, `bind_connector_metadata`, and
    `start_load_kv` when the step has synchronous loads. After it: `start_load_kv`
    (otherwise), `wait_for_save`, `get_transfer_results`,
    `get_block_ids_with_load_errors`, `get_kv_connector_stats`,
    `build_connector_worker_meta`, `clear_connector_metadata`.
    """

    def __init__(self, connector: KVConnectorBase_V1, cache: FakeKVCache) -> None:
        self.connector = connector
        self.cache = cache
        self._load_started = False
        connector.register_kv_caches(cache.tensors)

    @classmethod
    def create(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cache: FakeKVCache
    ) -> ConnectorWorker:
        """Build the configured connector in the worker role over `cache`."""
        connector = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        assert isinstance(connector, KVConnectorBase_V1)
        return cls(connector, cache)

    def before_forward(self, scheduler_output: SchedulerOutput) -> None:
        """Flush on preemption, bind this step's metadata, start synchronous loads."""
        metadata = scheduler_output.kv_connector_metadata
        assert metadata is not None
        self.connector.handle_preemptions(metadata)
        self.connector.bind_connector_metadata(metadata)
        self._load_started = scheduler_output.has_sync_kv_loads
        if self._load_started:
            self.connector.start_load_kv(None)  # type: ignore[arg-type]

    def after_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        """Start async loads, submit stores, and collect this step's output."""
        if not self._load_started:
            self.connector.start_load_kv(None)  # type: ignore[arg-type]
        self.connector.wait_for_save()
        output = self.results_output(scheduler_output)
        self.connector.clear_connector_metadata()
        return output

    def results_output(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """This step's output as vLLM's runners collect it after `wait_for_save`."""
        results = self.connector.get_transfer_results(scheduler_output.finished_req_ids)
        return KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=self.connector.get_block_ids_with_load_errors(),
            kv_connector_stats=self.connector.get_kv_connector_stats(),
            kv_connector_worker_meta=self.connector.build_connector_worker_meta(),
        )


@dataclass
class _PendingCopy:
    steps_left: int
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    event_id: int


class FakeSimpleOffloadWorker:
    """Stand-in for vLLM's SimpleCPUOffload worker: same metadata, plain tensor copies.

    Loads run `load_delay` and stores `store_delay` steps after they are planned (0: in
    the same step), each direction in order but independently of the other, like the real
    worker's two streams (a load may overtake an earlier store). Completions are reported
    the way the real worker reports them: finished loads as request ids in
    `finished_recving`, finished stores as `{event: 1}` worker metadata. A step whose
    metadata says `need_flush` completes everything outstanding first.
    """

    def __init__(
        self, cache: FakeKVCache, num_cpu_blocks: int, load_delay: int = 0, store_delay: int = 0
    ) -> None:
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        self._worker_meta_cls = SimpleCPUOffloadWorkerMetadata
        self.cache = cache
        self.load_delay = load_delay
        self.store_delay = store_delay
        self.cpu_tensors = {
            name: torch.zeros((num_cpu_blocks, *t.shape[1:]), dtype=t.dtype)
            for name, t in cache.tensors.items()
        }
        self._loads: deque[_PendingCopy] = deque()
        self._stores: deque[_PendingCopy] = deque()
        self._load_event_to_reqs: dict[int, list[str]] = {}
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0

    def before_forward(self, scheduler_output: SchedulerOutput) -> None:
        """Complete every outstanding copy when a preemption asks for a flush."""
        metadata = scheduler_output.kv_connector_metadata
        if metadata is not None and metadata.need_flush:
            for job in (*self._loads, *self._stores):
                job.steps_left = 0

    def after_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        """Queue this step's copies, run the due ones, report completions."""
        metadata = scheduler_output.kv_connector_metadata
        if metadata is not None:
            self._load_event_to_reqs.update(metadata.load_event_to_reqs)
            if metadata.load_event >= 0:
                self._loads.append(
                    _PendingCopy(
                        self.load_delay,
                        list(metadata.load_gpu_blocks),
                        list(metadata.load_cpu_blocks),
                        metadata.load_event,
                    )
                )
            if metadata.store_event >= 0:
                self._stores.append(
                    _PendingCopy(
                        self.store_delay,
                        list(metadata.store_gpu_blocks),
                        list(metadata.store_cpu_blocks),
                        metadata.store_event,
                    )
                )
        finished_recving: set[str] = set()
        for job in self._take_due(self._loads):
            for name, gpu in self.cache.tensors.items():
                gpu[job.gpu_block_ids] = self.cpu_tensors[name][job.cpu_block_ids]
            self.num_loaded_blocks += len(job.gpu_block_ids)
            finished_recving.update(self._load_event_to_reqs.pop(job.event_id, ()))
        done_stores: dict[int, int] = {}
        for job in self._take_due(self._stores):
            for name, gpu in self.cache.tensors.items():
                self.cpu_tensors[name][job.cpu_block_ids] = gpu[job.gpu_block_ids]
            self.num_stored_blocks += len(job.gpu_block_ids)
            done_stores[job.event_id] = 1
        return KVConnectorOutput(
            finished_recving=finished_recving or None,
            kv_connector_worker_meta=(
                self._worker_meta_cls(completed_store_events=done_stores) if done_stores else None
            ),
        )

    @staticmethod
    def _take_due(queue: deque[_PendingCopy]) -> list[_PendingCopy]:
        due = []
        while queue and queue[0].steps_left <= 0:
            due.append(queue.popleft())
        for job in queue:
            job.steps_left -= 1
        return due


def simple_offload_worker_factory(load_delay: int = 0, store_delay: int = 0) -> WorkerFactory:
    """Return a factory of `FakeSimpleOffloadWorker`s sized like the scheduler's pool."""

    def factory(harness: VllmHarness, cache: FakeKVCache) -> WorkerSide:
        manager = harness.scheduler.connector.scheduler_manager  # type: ignore[union-attr]
        return FakeSimpleOffloadWorker(cache, manager.num_cpu_blocks, load_delay, store_delay)

    return factory


def connector_worker_factory(harness: VllmHarness, cache: FakeKVCache) -> WorkerSide:
    """Build the configured connector in the worker role (one per rank).

    Every rank lives in this one process, so each is given the distributed rank its own
    worker process would see (it names the rank's disk tier file).
    """
    rank = harness.caches.index(cache)
    with mock.patch.object(worker_side, "distributed_rank", return_value=rank):
        return ConnectorWorker.create(harness.vllm_config, harness.kv_cache_config, cache)
