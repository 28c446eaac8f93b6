"""vLLM adapter: kvtier as a vLLM v1 KV connector (`KVTierConnector`, vLLM 0.33.x).

Use `kv_connector="KVTierConnector"` with `kv_connector_module_path="kvtier.adapters.vllm"`;
the connector (and vLLM) is imported only when that name is looked up, so kvtier stays
importable without vLLM. Modules:

- `connector`: `KVTierConnector`, dispatching to the two roles (imports vLLM).
- `scheduler_side` / `worker_side`: the scheduler and worker roles as calls of kvtier's
  `OffloadScheduler` / `OffloadWorker` (import vLLM).
- `load_tracker`: which requests' (possibly multi-event) loads are complete on a worker.
- `metadata`, `stats`, `scheduler_stats`: what crosses between the roles; stats and
  Prometheus metrics; the scheduler role's per-step stats payload.
- `worker_results`: what the worker role hands vLLM each step (finished and failed loads,
  suspect GPU blocks, worker metadata).
- `plan_memory`, `redelivery`: under vLLM's fault tolerance, what a rank that skipped a
  plan must still report or echo, and a worker output vLLM dropped, sent again once.
- `views`: vLLM's `Request` and GPU `BlockPool` as kvtier's `RequestView` / `GpuPoolView`.
- `layout`: vLLM's `KVCacheConfig` as kvtier's `KVLayout`; tier sizing.
- `regions`: byte views of vLLM's KV allocation from its placement.
- `events`: kvtier's KV events as vLLM's KV event classes.
- `config`: `kv_connector_extra_config` as an `OffloadConfig`.

`views`, `layout`, `regions`, `events`, `config` and `load_tracker` import without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.adapters.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
