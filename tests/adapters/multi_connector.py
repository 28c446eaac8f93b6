"""kvtier inside vLLM's `MultiConnector`, next to vLLM's SimpleCPUOffload connector
(test helper only; import after `pytest.importorskip("vllm")`).

The scheduler role is vLLM's real `MultiConnector` over both children's real scheduler
roles. Its worker role would build SimpleCPUOffload's worker, whose copies need CUDA,
so `MultiWorker` plays it instead: it hands each child its part of the step's
`MultiKVConnectorMetadata` (kvtier's real worker role, the harness's stand-in for
SimpleCPUOffload's) and merges their outputs the way `MultiConnector` does, their
worker-side stats included (`MultiKVConnectorStats` by connector class name).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any
from unittest import mock

from kvtier_vllm import CONNECTOR, MODULE, SLOT_BYTES
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorStats,
    MultiKVConnectorWorkerMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm_harness import (
    SIMPLE_CPU_OFFLOAD,
    ConnectorWorker,
    FakeKVCache,
    FakeSimpleOffloadWorker,
    HarnessConfig,
    VllmHarness,
    WorkerSide,
)

from kvtier.adapters.vllm import worker_side


def multi_config(
    order: tuple[str, ...] = ("kvtier", "simple"),
    num_cpu_blocks: int = 512,
    **overrides: Any,
) -> HarnessConfig:
    """Return a harness config running `MultiConnector` over kvtier and SimpleCPUOffload
    in `order`, each with a host pool of `num_cpu_blocks` blocks; `extra` entries in
    `overrides` (a dict) are merged into kvtier's `kv_connector_extra_config`."""
    policy = overrides.setdefault("kv_load_failure_policy", "recompute")
    kvtier_extra = {"cpu_bytes": num_cpu_blocks * SLOT_BYTES, **overrides.pop("extra", {})}
    children = {
        "kvtier": {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": kvtier_extra,
        },
        "simple": {
            "kv_connector": SIMPLE_CPU_OFFLOAD,
            "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"cpu_bytes_to_use": num_cpu_blocks * SLOT_BYTES},
        },
    }
    return HarnessConfig(
        connector="MultiConnector",
        extra_config={"connectors": [children[name] for name in order]},
        **overrides,
    )


class MultiWorker:
    """One rank's worker side of `MultiConnector`: each child gets its own metadata.

    `names` are the children's connector class names, which key their stats.
    """

    def __init__(self, children: list[WorkerSide], names: list[str]) -> None:
        if len(names) != len(children):
            raise ValueError("one connector class name per child")
        self.children = children
        self.names = names
        self._views: list[SchedulerOutput] = []

    def before_forward(self, scheduler_output: SchedulerOutput) -> None:
        """Split the step's metadata among the children and run theirs."""
        metadata = scheduler_output.kv_connector_metadata
        parts = metadata.metadata  # type: ignore[union-attr]
        self._views = [
            dataclasses.replace(scheduler_output, kv_connector_metadata=part) for part in parts
        ]
        for child, view in zip(self.children, self._views, strict=True):
            child.before_forward(view)

    def after_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """Merge the children's outputs as `MultiConnector`'s worker role does."""
        outputs = [
            child.after_forward(view) or KVConnectorOutput()
            for child, view in zip(self.children, self._views, strict=True)
        ]
        metas = tuple(out.kv_connector_worker_meta for out in outputs)
        # As `MultiConnector.get_kv_connector_stats`: by class name, None when none.
        stats = MultiKVConnectorStats()
        for name, out in zip(self.names, outputs, strict=True):
            child_stats = out.kv_connector_stats
            if child_stats is None:
                continue
            stats[name] = stats[name].aggregate(child_stats) if name in stats.data else child_stats
        return KVConnectorOutput(
            finished_sending=set().union(*(o.finished_sending or () for o in outputs)) or None,
            finished_recving=set().union(*(o.finished_recving or () for o in outputs)) or None,
            failed_recving=set().union(*(o.failed_recving for o in outputs)),
            invalid_block_ids=set().union(*(o.invalid_block_ids for o in outputs)),
            kv_connector_stats=stats if stats.data else None,
            kv_connector_worker_meta=(
                MultiKVConnectorWorkerMetadata(metadata=metas)
                if any(m is not None for m in metas)
                else None
            ),
        )


def multi_worker_factory(
    harness: VllmHarness, cache: FakeKVCache, simple_delays: tuple[int, int] = (0, 0)
) -> WorkerSide:
    """Build one rank's `MultiWorker`: kvtier's real worker role, SimpleCPUOffload's
    stand-in sized like its scheduler's pool, its loads and stores `simple_delays` late."""
    rank = harness.caches.index(cache)
    children: list[WorkerSide] = []
    names = []
    schedulers = harness.scheduler.connector.sub_connectors  # type: ignore[union-attr]
    pairs = MultiConnector._get_connector_classes_and_configs(harness.vllm_config)
    for (cls, config), scheduler_role in zip(pairs, schedulers, strict=True):
        names.append(cls.__name__)
        if cls.__name__ == SIMPLE_CPU_OFFLOAD:
            num_cpu_blocks = scheduler_role.scheduler_manager.num_cpu_blocks
            children.append(FakeSimpleOffloadWorker(cache, num_cpu_blocks, *simple_delays))
            continue
        with mock.patch.object(worker_side, "distributed_rank", return_value=rank):
            connector = cls(config, KVConnectorRole.WORKER, harness.kv_cache_config)
        children.append(ConnectorWorker(connector, cache))  # type: ignore[arg-type]
    return MultiWorker(children, names)


def multi_harness(
    order: tuple[str, ...] = ("kvtier", "simple"),
    num_cpu_blocks: int = 512,
    simple_delays: tuple[int, int] = (0, 0),
    **overrides: Any,
) -> VllmHarness:
    """Return a harness running `MultiConnector` over kvtier and SimpleCPUOffload (its
    stand-in worker's loads and stores `simple_delays` steps late)."""
    config = multi_config(order, num_cpu_blocks, **overrides)
    return VllmHarness(config, partial(multi_worker_factory, simple_delays=simple_delays))


def simple_worker(harness: VllmHarness, rank: int = 0) -> FakeSimpleOffloadWorker:
    """Return one rank's SimpleCPUOffload stand-in."""
    worker = harness.workers[rank]
    assert isinstance(worker, MultiWorker)
    (simple,) = [c for c in worker.children if isinstance(c, FakeSimpleOffloadWorker)]
    return simple
