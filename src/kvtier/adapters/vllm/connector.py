"""`KVTierConnector`: kvtier as a vLLM 0.33 v1 KV connector (scheduler and worker roles).

Load it with `kv_connector="KVTierConnector"`, `kv_connector_module_path=
"kvtier.adapters.vllm"`, `kv_role="kv_both"` and kvtier's settings in
`kv_connector_extra_config` (see `config`). Set `kv_load_failure_policy="recompute"`:
with vLLM's default ("fail") a failed tier load fails its request instead of recomputing.

The class only dispatches: `SchedulerSide` translates the scheduler role for kvtier's
`OffloadScheduler`, `WorkerSide` the worker role for kvtier's `OffloadWorker`. Whole
blocks move asynchronously, so the per-layer hooks (`wait_for_layer_load`,
`save_kv_layer`) do nothing.

Hit sources (`vllm:prompt_tokens_cached_by_source`): a CPU tier's hits are `host`, a disk
tier's `disk`. With the CPU+disk cascade each request's hit is split by the tier that
serves each block (`get_external_cache_hit_sources`): blocks loaded from the CPU tier count
as `host`, those loaded from disk as `disk`; without a split the first tier (`host`) is
reported.

Importing this module registers `KVTierConnector` with vLLM's `KVConnectorFactory`
(`register_with_vllm`), which `MultiConnector` needs to rebuild its stats.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.utils import get_pp_indices
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.adapters.vllm.config import offload_config_from_vllm
from kvtier.adapters.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.adapters.vllm.scheduler_side import SchedulerSide
from kvtier.adapters.vllm.stats import GAUGES, INFO, KVTierPromMetrics, KVTierStats
from kvtier.adapters.vllm.worker_side import WorkerSide
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier

logger = logging.getLogger(__name__)


def pipeline_stage_layers(vllm_config: Any) -> tuple[int, ...]:
    """Return the hidden layers of each pipeline stage as vLLM splits them (empty: no PP).

    The same split vLLM's models use (`get_pp_indices`, `VLLM_PP_LAYER_PARTITION` included),
    so every process of one engine computes the same tuple.
    """
    num_stages = vllm_config.parallel_config.pipeline_parallel_size
    if num_stages == 1:
        return ()
    num_layers = vllm_config.model_config.get_total_num_hidden_layers()
    bounds = (get_pp_indices(num_layers, stage, num_stages) for stage in range(num_stages))
    return tuple(end - start for start, end in bounds)


def connector_config(vllm_config: Any) -> OffloadConfig:
    """Return kvtier's config for this engine from vLLM's (one rank's budgets)."""
    transfer = vllm_config.kv_transfer_config
    events_config = vllm_config.kv_events_config
    return offload_config_from_vllm(
        transfer.kv_connector_extra_config or {},
        world_size=vllm_config.parallel_config.world_size,
        max_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        events=bool(events_config is not None and events_config.enable_kv_cache_events),
    )


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Offload vLLM's prefix cache to kvtier's CPU tier, disk tier or both; translation only."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("KVTierConnector needs prefix caching (--enable-prefix-caching)")
        kv_role = self._kv_transfer_config.kv_role
        if kv_role != "kv_both":
            # A loading connector needs vLLM's consumer behaviour (under overlapped
            # scheduling, blocks a step may still write are freed late, so no load fills
            # them early) and stores need the producer's: only kv_both gives both.
            raise ValueError(
                f"KVTierConnector stores and loads KV: kv_role must be 'kv_both', got {kv_role!r}"
            )
        self.offload_config = connector_config(vllm_config)
        self._cache_hit_source = _HIT_SOURCES[self.offload_config.tier]
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        stages = pipeline_stage_layers(vllm_config)
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                vllm_config, kv_cache_config, self.offload_config, stages
            )
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning(
                    "kvtier: kv_load_failure_policy=%r fails a request whose tier load "
                    "fails; set kv_load_failure_policy='recompute' to recompute it instead",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
        else:
            layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
            self._worker = WorkerSide(kv_cache_config, self.offload_config, layout, stages)

    @property
    def requires_kv_delivery(self) -> bool:
        """Return False: a dropped store is a future cache miss, never lost output."""
        return False

    @property
    def scheduler_side(self) -> SchedulerSide:
        """Return the scheduler role's translator; raises in the worker role.

        Methods vLLM calls every step or request read `self._scheduler or
        self.scheduler_side`: the property only when it raises (each Python call entered
        costs ~0.5 µs between engine steps).
        """
        if self._scheduler is None:
            raise RuntimeError("not the scheduler role of KVTierConnector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        """Return the worker role's translator; raises in the scheduler role."""
        if self._worker is None:
            raise RuntimeError("not the worker role of KVTierConnector")
        return self._worker

    # ================================================================ worker role

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Address vLLM's KV allocation (from the config's placement) and allocate the tier."""
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Flush outstanding transfers when the plan says a request was preempted."""
        self.worker_side.handle_preemptions(_metadata(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's transfer plan."""
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.bind(_metadata(connector_metadata))

    def clear_connector_metadata(self) -> None:
        """Forget this step's transfer plan."""
        super().clear_connector_metadata()
        self.worker_side.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Submit this step's loads; they complete asynchronously."""
        self.worker_side.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Do nothing: loads are whole blocks, finished before the request runs."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Do nothing: stores are whole blocks, submitted in `wait_for_save`."""

    def wait_for_save(self) -> None:
        """Submit this step's stores, ordered after the forward's KV writes; never blocks."""
        self.worker_side.submit_stores()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Return loads finished or failed since the last step (kvtier never delays frees)."""
        finished, failed = self.worker_side.take_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Return the GPU blocks whose load failed, of requests `get_transfer_results`
        reported finished (not failed): vLLM recomputes each from its first such block.

        Only where the worker named the bad blocks and the layout is one full-attention
        group (`worker_side.block_level_failures`); other failures are `failed_recving`.
        """
        return self.worker_side.take_invalid_blocks()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Return (None, finished loads) for callers of the older API.

        Raises RuntimeError when a load failed, whole or by block: this API cannot say
        so, and reporting the load as finished would serve wrong KV. vLLM 0.33 calls
        `get_transfer_results` and `get_block_ids_with_load_errors`.
        """
        results = self.get_transfer_results(finished_req_ids)
        invalid = self.get_block_ids_with_load_errors()
        if results.failed_recving or invalid:
            raise RuntimeError(
                f"kvtier loads failed for {sorted(results.failed_recving)} (GPU blocks "
                f"{sorted(invalid)} not loaded); get_finished() cannot report failures, "
                "use get_transfer_results() and get_block_ids_with_load_errors()"
            )
        return None, results.finished_recving or None

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        """Return the transfer events this rank finished, for the scheduler role."""
        return self.worker_side.take_worker_metadata()

    def shutdown(self) -> None:
        """Finish outstanding transfers and free the tier."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.release_stats_source()

    # ================================================================ scheduler role

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Wrap vLLM's GPU block pool as kvtier's GPU pool view."""
        self.scheduler_side.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Any) -> None:
        """Remember the request."""
        (self._scheduler or self.scheduler_side).add_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return the tokens the tier holds past the local hit, loaded asynchronously."""
        return (self._scheduler or self.scheduler_side).lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the load of the accepted external tokens into the allocated blocks."""
        (self._scheduler or self.scheduler_side).on_allocated(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Split the request's accepted hit by the tier serving it (host / disk)."""
        if num_external_tokens == 0:
            return {}
        split = (self._scheduler or self.scheduler_side).hit_split(
            request.request_id, num_external_tokens
        )
        if split is None:
            return {self._cache_hit_source: num_external_tokens}
        return {_HIT_SOURCES[tier]: n for tier, n in split.items() if n}

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        """Return this step's transfer plan for every worker."""
        return (self._scheduler or self.scheduler_side).build_metadata(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Apply the workers' merged report."""
        (self._scheduler or self.scheduler_side).apply_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Flush the finished request's blocks (one KV group); never delays the free."""
        (self._scheduler or self.scheduler_side).on_finished(request, (block_ids,))
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Flush the finished request's blocks (every group); never delays the free."""
        (self._scheduler or self.scheduler_side).on_finished(request, block_ids)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Return True while stores are queued or in flight, so vLLM keeps stepping."""
        return self._scheduler is not None and self._scheduler.has_pending_stores()

    def has_pending_block_frees(self) -> bool:
        """Return True when a store or load in flight holds the last reference on a GPU
        block: vLLM, short of blocks, then waits for the transfer to be reported instead
        of preempting a running request (whose KV it would recompute or reload)."""
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def take_events(self) -> Iterable[Any]:
        """Return this step's tier events as vLLM KV events (medium CPU or STORAGE)."""
        return (self._scheduler or self.scheduler_side).take_events()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """Return this step's offload stats (scheduler role; workers report none)."""
        return None if self._scheduler is None else self._scheduler.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        """Rebuild stats from their payload (front-end process); the payload is copied,
        because `aggregate` adds into the stats it is called on."""
        sections = {} if data is None else {name: dict(value) for name, value in data.items()}
        for section in (GAUGES, INFO):  # by source: each source's values copied too
            if section in sections:
                sections[section] = {k: dict(v) for k, v in sections[section].items()}
        return KVTierStats(data=sections)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        """Register kvtier's Prometheus metrics (prefix `kvtier:`)."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool:
        """Drop the tier's contents; False while issued transfers are outstanding."""
        return self.scheduler_side.reset()


_HIT_SOURCES = {Tier.CPU: CacheHitSource.HOST, Tier.DISK: CacheHitSource.DISK}
CONNECTOR_NAME = "KVTierConnector"


def register_with_vllm() -> None:
    """Register `KVTierConnector` by name in vLLM's connector factory (idempotent).

    vLLM loads the connector from `kv_connector_module_path`, but `MultiConnector`
    rebuilds its children's stats in the front-end process by registered name
    (`KVConnectorFactory.get_connector_class_by_name`). A name already registered (this
    module imported again, or another registration) is left as it is.
    """
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, "KVTierConnector")
    except ValueError:  # the factory's only refusal: the name is already registered
        logger.debug("%s is already registered with vLLM's connector factory", CONNECTOR_NAME)


def _metadata(metadata: KVConnectorMetadata) -> KVTierMetadata:
    if not isinstance(metadata, KVTierMetadata):
        raise TypeError(f"expected KVTierMetadata, got {type(metadata).__name__}")
    return metadata


register_with_vllm()
