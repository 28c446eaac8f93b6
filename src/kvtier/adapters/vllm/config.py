"""`kv_connector_extra_config` translated into kvtier's `OffloadConfig`.

Two spellings are accepted, never mixed for one setting:

- kvtier's own keys (SPEC §8, `OffloadConfig.from_dict`): `cpu_bytes`, `disk_bytes`,
  `disk_path` (a directory; each rank creates its own file in it), `disk_io_mode` /
  `disk_direct_io`, `disk_buffer_slots`, `num_blocks`, `store_mode`, `fine_grained_hits`,
  `token_check`, `cascade`, and `policy` (`"EVICTION[+ADMISSION]"`, e.g. `"arc"` or `"lru+door"`; or
  the two halves as `eviction_policy` / `admission_policy`). Byte budgets are per rank.
- vLLM SimpleCPUOffloadConnector's keys, so a deployment can swap connectors without
  touching its config: `cpu_bytes_to_use` (one engine's total, divided by vLLM's world size,
  tensor x pipeline ranks: each data-parallel engine takes it again; under the external
  launcher that world size counts every engine, and vLLM's own connectors divide by it too),
  `cpu_bytes_to_use_per_rank`, `num_cpu_blocks`, `lazy_offload`, `kv_offload_backend`
  (`"cpu"` | `"disk"` | `"cascade"` / `"cpu+disk"`), `disk_capacity_bytes` (per rank),
  `use_page_cache`, and the shared `disk_path`, `disk_buffer_slots`, `cascade`. Their
  values are checked under these names, before translation, and a later error on a
  translated value names them too. With `kv_offload_backend` `"cpu"` (its default) the
  disk-only ones are ignored with a warning, as vLLM does (a size of 0 silently).

One key per setting: `disk_io_mode`, `disk_direct_io` and `use_page_cache` all set the
disk I/O mode, so any two of them together are refused.

As a templated config writes them: every int key takes a string of decimal digits
(`"4"`) or a whole float (`8e9`), as vLLM reads its sizes with `int()`; a `disk_path` of
`""` or None with no disk tier is taken as none, and a size of 0 for the tier
`kv_offload_backend` leaves out as that tier's absence; a null `num_cpu_blocks` (as
`num_blocks`) is unset. Each stays refused where it would ask for a tier in use.

CPU and disk together (`cpu_bytes` and `disk_bytes` both set, or `kv_offload_backend`
`"cascade"`) form the cascade GPU → CPU → DISK; `cascade` (`"write_through"`, the
default, or `"write_back"`) says how blocks reach the disk.

Settings vLLM owns are taken from vLLM and rejected as keys: `events` (vLLM's
`kv_events_config.enable_kv_cache_events`), `max_batched_tokens`
(`scheduler_config.max_num_batched_tokens`), `hash_algo` / `hash_seed` (vLLM hashes the
blocks: `--prefix-caching-hash-algo`, `PYTHONHASHSEED`). `disk_persist=True` is rejected
too: vLLM's block hashes are seeded per process unless PYTHONHASHSEED is set, and the
adapter cannot fingerprint the model's weights cheaply, so a kept disk tier could serve
another model's KV; persistence is available in kvtier's reference engine only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from kvtier.core.plural import counted
from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES, PolicySpec
from kvtier.offload.config import (
    CONFIG_KEYS,
    ConfigError,
    OffloadConfig,
    check_known_keys,
)

logger = logging.getLogger(__name__)

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
_POLICY_KEYS = ("eviction_policy", "admission_policy")
_DISK_IO_KEYS = ("disk_io_mode", "disk_direct_io", "use_page_cache")
_BACKENDS = ("cpu", "disk", "cascade", "cpu+disk")
_ALIASES = (
    "cpu_bytes_to_use",
    "cpu_bytes_to_use_per_rank",
    "num_cpu_blocks",
    "lazy_offload",
    "kv_offload_backend",
    "disk_capacity_bytes",
    "use_page_cache",
)
_DISK_ONLY_ALIASES = ("disk_capacity_bytes", "use_page_cache")
# Every key the connector takes; the ones vLLM owns are refused first, with the reason.
_KEYS = (CONFIG_KEYS - _OWNED_BY_VLLM.keys()) | {"policy", *_ALIASES}


def offload_config_from_vllm(
    extra: Mapping[str, Any], world_size: int, max_batched_tokens: int, events: bool
) -> OffloadConfig:
    """Return the `OffloadConfig` for one rank; raise `ConfigError` naming a bad key."""
    values = dict(extra)
    for key, reason in _OWNED_BY_VLLM.items():
        if key in values:
            raise ConfigError(f"{key} cannot be set in kv_connector_extra_config: {reason}")
    suggest = _keys_to_suggest(values)
    notes = _tier_notes(values)
    check_known_keys(values, _KEYS, "kv_connector_extra_config", suggest, _OTHER_SPELLING, notes)
    if "num_cpu_blocks" in values and values["num_cpu_blocks"] is None:
        del values["num_cpu_blocks"]  # unset, as for vLLM's connector and num_blocks
    for key in _INT_KEYS:
        if key in values:
            values[key] = _whole_number(key, values[key])
    _check_persistence(values)
    _check_one_disk_io_key(values)
    if "policy" in values:
        values.update(_policy(values.pop("policy"), values))
    _check_policy_halves(values)
    sources: dict[str, str] = {}
    no_disk_tier = None
    if any(key in values for key in _ALIASES):
        if _backend(values) == "cpu":  # what the user wrote instead of disk_bytes
            no_disk_tier = f"kv_offload_backend={values.get('kv_offload_backend', 'cpu')!r}"
        values, sources = _from_simple_offload_keys(values, world_size)
    values["max_batched_tokens"] = max_batched_tokens
    values["events"] = events
    return OffloadConfig.from_dict(values, key_sources=sources, no_disk_tier=no_disk_tier)


# What to offer for a misspelt key that is closest to a key not offered beside the keys
# given: the setting's other spelling; `disk_persist` itself (unlisted: only False is
# taken, and True gets its reason).
_OTHER_SPELLING = {
    "cpu_bytes": "cpu_bytes_to_use",
    "disk_bytes": "disk_capacity_bytes",
    "num_blocks": "num_cpu_blocks",
    "store_mode": "lazy_offload",
    "cpu_bytes_to_use": "cpu_bytes",
    "cpu_bytes_to_use_per_rank": "cpu_bytes",
    "disk_capacity_bytes": "disk_bytes",
    "num_cpu_blocks": "num_blocks",
    "lazy_offload": "store_mode",
    "disk_persist": "disk_persist",
}


def _keys_to_suggest(values: Mapping[str, Any]) -> set[str]:
    """Return the keys an unknown key may be taken for: not those of the other spelling
    of a setting given (refused together), nor `disk_persist` (only False is taken: not
    listed, but offered for a misspelling of it, `_OTHER_SPELLING`)."""
    keys = set(_KEYS) - {"disk_persist"}
    spellings = (set(_NATIVE_SIZING_KEYS), set(_ALIASES)), ({"policy"}, set(_POLICY_KEYS))
    for ours, theirs in spellings:
        for given, other in ((ours, theirs), (theirs, ours)):
            if given & values.keys():
                keys -= other
    io_given = [key for key in _DISK_IO_KEYS if key in values]
    return keys - set(_DISK_IO_KEYS) | set(io_given) if io_given else keys


def _tier_notes(values: Mapping[str, Any]) -> dict[str, str]:
    """Return a note for each key the backend would ignore (with a warning), to say
    beside it when it is offered for a misspelt key: `disk_size` is taken for
    `disk_capacity_bytes`, which `kv_offload_backend="cpu"` (the default) ignores.
    kvtier's shared disk keys are ignored only beside SimpleCPUOffloadConnector's."""
    given = "kv_offload_backend" in values
    written = f"kv_offload_backend={values.get('kv_offload_backend', 'cpu')!r}"
    written += "" if given else " (its default)"
    if _backend(values) == "cpu":
        shared = ("disk_path", "disk_buffer_slots", "disk_io_mode", "disk_direct_io")
        keys = (*_DISK_ONLY_ALIASES, *(shared if any(key in values for key in _ALIASES) else ()))
        note = f'{written} has no disk tier: set kv_offload_backend to "disk" or "cascade" for one'
    elif _backend(values) == "disk":
        keys = ("cpu_bytes_to_use", "cpu_bytes_to_use_per_rank")
        note = f'{written} has no CPU tier: set kv_offload_backend to "cpu" or "cascade" for one'
    else:
        return {}
    return dict.fromkeys(keys, note)


def _backend(values: Mapping[str, Any]) -> object:
    """Return `kv_offload_backend` as compared (any case), default "cpu"."""
    backend = values.get("kv_offload_backend", "cpu")
    return backend.strip().lower() if isinstance(backend, str) else backend


def _from_simple_offload_keys(
    values: dict[str, Any], world_size: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """Rewrite SimpleCPUOffloadConnector's keys as kvtier keys; also return their sources.

    Every value is checked under the key the user wrote before it is translated. The
    sources (kvtier key -> what the user wrote) let a later error on a translated value
    name the user's keys too.
    """
    clash = sorted(k for k in _NATIVE_SIZING_KEYS if k in values)
    if clash:
        theirs = ", ".join(k for k in _ALIASES if k in values)
        raise ConfigError(
            f"{', '.join(clash)} mixed with SimpleCPUOffloadConnector keys ({theirs}): "
            "use one spelling"
        )
    backend = _backend(values)  # any case, as the other names
    given = "kv_offload_backend" in values
    written = f"kv_offload_backend={values.pop('kv_offload_backend', 'cpu')!r}"
    written += "" if given else " (its default)"
    if backend not in _BACKENDS:
        choices = ", ".join(repr(b) for b in _BACKENDS)
        raise ConfigError(f"kv_offload_backend must be one of {choices}, got {backend!r}")
    for key in _VLLM_BYTE_KEYS:
        if key in values:
            _check_tier_size(key, values[key], backend, written)
    # A size of 0 for the tier the backend leaves out agrees with it: nothing is ignored.
    off = {key for key in _VLLM_BYTE_KEYS if values.get(key) == 0}
    ignored = [k for k in _DISK_ONLY_ALIASES if k in values and k not in off]
    ignored = ignored if backend == "cpu" else []
    sources = {
        "cpu_bytes": f"{_given_or_default('cpu_bytes_to_use', values)} / "
        f"{counted(world_size, 'rank')}",
        "disk_bytes": _given_or_default("disk_capacity_bytes", values),
        "num_blocks": "num_cpu_blocks",
        "store_mode": "lazy_offload",
    }
    _warn_of_unused_cpu_keys({k: v for k, v in values.items() if k not in off}, backend, world_size)
    server_bytes = values.pop("cpu_bytes_to_use", _DEFAULT_SERVER_CPU_BYTES)
    per_rank = values.pop("cpu_bytes_to_use_per_rank", None)
    disk_bytes = values.pop("disk_capacity_bytes", _DEFAULT_DISK_BYTES)
    if backend != "cpu":  # "disk", or the cascade's disk tier
        values["disk_bytes"] = disk_bytes
    if backend != "disk":  # "cpu", or the cascade's CPU tier
        if per_rank is not None:
            values["cpu_bytes"] = per_rank
            sources["cpu_bytes"] = "cpu_bytes_to_use_per_rank"
        elif server_bytes < world_size:
            raise ConfigError(
                f"cpu_bytes_to_use={server_bytes} is invalid: it is divided over "
                f"{counted(world_size, 'rank')}, which leaves each less than one byte"
            )
        else:
            values["cpu_bytes"] = server_bytes // world_size
    if "num_cpu_blocks" in values:
        values["num_blocks"] = _positive_int("num_cpu_blocks", values.pop("num_cpu_blocks"), 2)
    if "lazy_offload" in values:
        lazy = values.pop("lazy_offload")
        if not isinstance(lazy, bool):
            raise ConfigError(f"lazy_offload must be a bool, got {lazy!r}")
        values["store_mode"] = "lazy" if lazy else "eager"
    if "use_page_cache" in values:
        page_cache = values.pop("use_page_cache")
        if not isinstance(page_cache, bool):
            raise ConfigError(f"use_page_cache must be a bool, got {page_cache!r}")
        if backend != "cpu":
            values["disk_io_mode"] = "page_cache" if page_cache else "direct"
    if ignored:  # as vLLM's connector warns, under the names the user wrote
        logger.warning(
            'kv_offload_backend="cpu" has no disk tier: ignoring %s (set kv_offload_backend '
            'to "disk" or "cascade" for one)',
            ", ".join(ignored),
        )
    return values, {key: source for key, source in sources.items() if key in values}


def _warn_of_unused_cpu_keys(values: Mapping[str, Any], backend: str, world_size: int) -> None:
    """Warn, as vLLM's connector does, of CPU sizes that will not be used as written."""
    given = [key for key in ("cpu_bytes_to_use", "cpu_bytes_to_use_per_rank") if key in values]
    if backend == "disk" and given:
        logger.warning(
            'kv_offload_backend="disk" has no CPU tier: ignoring %s (set kv_offload_backend '
            'to "cpu" or "cascade" for one)',
            ", ".join(given),
        )
    elif len(given) == 2 and values[given[0]] // world_size != values[given[1]]:
        logger.warning(
            "cpu_bytes_to_use_per_rank=%d != cpu_bytes_to_use / %s = %d: using "
            "cpu_bytes_to_use_per_rank",
            values[given[1]],
            counted(world_size, "rank"),
            values[given[0]] // world_size,
        )


def _given_or_default(key: str, values: Mapping[str, Any]) -> str:
    """Name `key` as the source of a translated value: the key itself, or its default."""
    return key if key in values else f"{key}'s default"


def _check_one_disk_io_key(values: Mapping[str, Any]) -> None:
    """Refuse two keys for the disk I/O mode: a silent winner would hide the other."""
    given = [key for key in _DISK_IO_KEYS if key in values]
    if len(given) > 1:
        first, second = given[:2]
        raise ConfigError(
            f"{first}={values[first]!r} and {second}={values[second]!r} both set the disk "
            "I/O mode: use one of them"
        )


def _check_persistence(values: dict[str, Any]) -> None:
    """Refuse `disk_persist=True`: the adapter cannot tell whose KV a kept tier holds."""
    if "disk_persist" not in values:
        return
    persist = values.pop("disk_persist")
    if persist is True:
        raise ConfigError(
            "disk_persist=True is not supported by the vLLM connector: vLLM's block hashes "
            "are seeded per process unless PYTHONHASHSEED is set, and the connector cannot "
            "fingerprint the model's weights, so a kept disk tier could serve stale KV; "
            "persistence is available in kvtier's reference engine only (remove disk_persist)"
        )
    if persist is not False:
        raise ConfigError(f"disk_persist must be a bool, got {persist!r}")


def _policy(value: object, values: Mapping[str, Any]) -> dict[str, str]:
    """Return `policy` (`EVICTION[+ADMISSION]`) as `OffloadConfig`'s two policy keys."""
    clash = sorted(k for k in _POLICY_KEYS if k in values)
    if clash:
        raise ConfigError(f"policy mixed with {', '.join(clash)}: use one spelling")
    if not isinstance(value, str):
        raise ConfigError(f"policy must be a string such as 'lru' or 'arc+door', got {value!r}")
    try:
        spec = PolicySpec.parse(value)
    except ValueError as error:
        raise ConfigError(f"policy={value!r} is invalid: {error}") from None
    return {"eviction_policy": spec.eviction, "admission_policy": spec.admission}


def _check_policy_halves(values: Mapping[str, Any]) -> None:
    """Point a combined `EVICTION+ADMISSION` name given as one half to `policy`."""
    names_of: dict[str, Mapping[str, object]] = {
        "eviction_policy": EVICTION_POLICIES,
        "admission_policy": ADMISSION_POLICIES,
    }
    for key, names in names_of.items():
        value = values.get(key)
        if isinstance(value, str) and "+" in value:
            raise ConfigError(
                f"{key}={value!r} is invalid: {key} takes one of {', '.join(names)}; give "
                f"an 'EVICTION+ADMISSION' name as policy={value!r}"
            )


# vLLM's SimpleCPUOffloadConnector reads its sizes with int(): a JSON 8e9 or "8589934592"
# works there, so it works here (a config moves between connectors unchanged), and so
# for every int key: a config assembled by shell or helm templating often holds "4".
_VLLM_BYTE_KEYS = ("cpu_bytes_to_use", "cpu_bytes_to_use_per_rank", "disk_capacity_bytes")
_INT_KEYS = (
    "cpu_bytes",
    "disk_bytes",
    "disk_buffer_slots",
    "num_blocks",
    "num_cpu_blocks",
    *_VLLM_BYTE_KEYS,
)
_DECIMAL = re.compile(r"[+-]?[0-9]+")


def _whole_number(key: str, value: object) -> object:
    """Return a whole-number float or a string of decimal digits (a sign allowed) as an
    int; anything else unchanged, for the key's own check to refuse naming it. int()
    would truncate 1.5 silently, and read "1_000" or other scripts' digits."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, float):
        raise ConfigError(f"{key} must be a whole number, got {value!r}")
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        try:
            return int(value.strip())
        except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits)
            raise ConfigError(f"{key} must be an int, got {value[:40]!r}...") from None
    return value


def _check_tier_size(key: str, value: object, backend: object, written: str) -> None:
    """Refuse a byte size that is not an int, or is below 1 for a tier the backend uses
    (0 is taken for a tier it leaves out: `disk_capacity_bytes=0` with "cpu")."""
    cpu_key = key != "disk_capacity_bytes"
    used = backend != ("disk" if cpu_key else "cpu")
    if used and value == 0 and not isinstance(value, bool):
        tier, other = ("CPU", "disk") if cpu_key else ("disk", "cpu")
        raise ConfigError(
            f"{key}=0 is invalid: {written} has a {tier} tier, which "
            f"needs at least 1 byte (for none, set kv_offload_backend to {other!r})"
        )
    _positive_int(key, value, minimum=1 if used else 0)


def _positive_int(key: str, value: object, minimum: int) -> int:
    """Return `value` if it is an int of at least `minimum`; raise naming `key` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key}={value!r} is invalid: must be >= {minimum}")
    return value
