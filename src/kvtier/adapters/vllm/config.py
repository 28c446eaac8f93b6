"""`kv_connector_extra_config` translated into kvtier's `OffloadConfig`.

Two spellings are accepted, never mixed for one setting:

- kvtier's own keys (SPEC §8, `OffloadConfig.from_dict`): `cpu_bytes`, `disk_bytes`,
  `disk_path` (a directory; each rank creates its own file in it), `disk_io_mode` /
  `disk_direct_io`, `disk_buffer_slots`, `num_blocks`, `store_mode`, `fine_grained_hits`,
  and `policy` (the tier's eviction order; only `"lru"` so far). Byte budgets are per
  rank.
- vLLM SimpleCPUOffloadConnector's keys, so a deployment can swap connectors without
  touching its config: `cpu_bytes_to_use` (whole server, divided by the world size),
  `cpu_bytes_to_use_per_rank`, `num_cpu_blocks`, `lazy_offload`, `kv_offload_backend`
  (`"cpu"` | `"disk"`), `disk_capacity_bytes` (per rank), `use_page_cache`, and the
  shared `disk_path`, `disk_buffer_slots`.

Settings vLLM owns are taken from vLLM and rejected as keys: `events` (vLLM's
`kv_events_config.enable_kv_cache_events`), `max_batched_tokens`
(`scheduler_config.max_num_batched_tokens`), `hash_algo` / `hash_seed` (vLLM hashes the
blocks: `--prefix-caching-hash-algo`, `PYTHONHASHSEED`).

One lower tier at a time: the CPU+disk cascade (`"cascade"`, `kv_offload_backend` of
`"cascade"`/`"cpu+disk"`, or both `cpu_bytes` and `disk_bytes`) is rejected with a message
saying it is not available yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.core.policies import PolicySpec
from kvtier.offload.config import ConfigError, OffloadConfig

# SimpleCPUOffloadConnector's defaults, for configs written in its spelling.
_DEFAULT_SERVER_CPU_BYTES = 8 * 1024**3
_DEFAULT_DISK_BYTES = 100 * 1024**3
_OWNED_BY_VLLM = {
    "events": "enable KV events in vLLM (kv_events_config.enable_kv_cache_events)",
    "max_batched_tokens": "vLLM's --max-num-batched-tokens is used",
    "hash_algo": "vLLM hashes the blocks: set --prefix-caching-hash-algo",
    "hash_seed": "vLLM hashes the blocks: set PYTHONHASHSEED",
}
_NATIVE_SIZING_KEYS = ("cpu_bytes", "disk_bytes", "num_blocks", "store_mode")
_CASCADE_MESSAGE = (
    "the CPU+disk cascade is not available yet: configure one lower tier (cpu_bytes or disk_bytes)"
)
_SUPPORTED_POLICIES = ("lru",)
_ALIASES = (
    "cpu_bytes_to_use",
    "cpu_bytes_to_use_per_rank",
    "num_cpu_blocks",
    "lazy_offload",
    "kv_offload_backend",
    "disk_capacity_bytes",
    "use_page_cache",
)


def offload_config_from_vllm(
    extra: Mapping[str, Any], world_size: int, max_batched_tokens: int, events: bool
) -> OffloadConfig:
    """Return the `OffloadConfig` for one rank; raise `ConfigError` naming a bad key."""
    values = dict(extra)
    for key, reason in _OWNED_BY_VLLM.items():
        if key in values:
            raise ConfigError(f"{key} cannot be set in kv_connector_extra_config: {reason}")
    if "cascade" in values:
        raise ConfigError(f"cascade={values['cascade']!r}: {_CASCADE_MESSAGE}")
    if "policy" in values:
        _check_policy(values.pop("policy"))
    if any(key in values for key in _ALIASES):
        values = _from_simple_offload_keys(values, world_size)
    values["max_batched_tokens"] = max_batched_tokens
    values["events"] = events
    return OffloadConfig.from_dict(values)


def _from_simple_offload_keys(values: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Rewrite SimpleCPUOffloadConnector's keys as kvtier keys."""
    clash = sorted(k for k in _NATIVE_SIZING_KEYS if k in values)
    if clash:
        raise ConfigError(
            f"{', '.join(clash)} mixed with SimpleCPUOffloadConnector keys: use one spelling"
        )
    backend = values.pop("kv_offload_backend", "cpu")
    if backend in ("cascade", "cpu+disk"):
        raise ConfigError(f"kv_offload_backend={backend!r}: {_CASCADE_MESSAGE}")
    if backend not in ("cpu", "disk"):
        raise ConfigError(f"kv_offload_backend must be 'cpu' or 'disk', got {backend!r}")
    server_bytes = values.pop("cpu_bytes_to_use", _DEFAULT_SERVER_CPU_BYTES)
    per_rank = values.pop("cpu_bytes_to_use_per_rank", None)
    disk_bytes = values.pop("disk_capacity_bytes", _DEFAULT_DISK_BYTES)
    if backend == "disk":
        values["disk_bytes"] = _int_key("disk_capacity_bytes", disk_bytes)
    elif per_rank is not None:
        values["cpu_bytes"] = _int_key("cpu_bytes_to_use_per_rank", per_rank)
    else:
        values["cpu_bytes"] = _int_key("cpu_bytes_to_use", server_bytes) // world_size
    if "num_cpu_blocks" in values:
        values["num_blocks"] = values.pop("num_cpu_blocks")
    if "lazy_offload" in values:
        lazy = values.pop("lazy_offload")
        if not isinstance(lazy, bool):
            raise ConfigError(f"lazy_offload must be a bool, got {lazy!r}")
        values["store_mode"] = "lazy" if lazy else "eager"
    if "use_page_cache" in values:
        page_cache = values.pop("use_page_cache")
        if not isinstance(page_cache, bool):
            raise ConfigError(f"use_page_cache must be a bool, got {page_cache!r}")
        values["disk_io_mode"] = "page_cache" if page_cache else "direct"
    return values


def _check_policy(value: object) -> None:
    """Accept the tier policy the offload scheduler implements; name anything else."""
    if not isinstance(value, str):
        raise ConfigError(f"policy must be a string such as 'lru', got {value!r}")
    try:
        name = PolicySpec.parse(value).name
    except ValueError as error:
        raise ConfigError(f"policy={value!r} is invalid: {error}") from None
    if name not in _SUPPORTED_POLICIES:
        raise ConfigError(
            f"policy={value!r} is not available in the offload scheduler yet; "
            f"choose one of {', '.join(repr(p) for p in _SUPPORTED_POLICIES)}"
        )


def _int_key(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an int, got {value!r}")
    return value
