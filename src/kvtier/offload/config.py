"""Offload configuration (SPEC §8) and lower-tier sizing (SPEC §6.1).

The modes and the checks of single field values are `config_fields`'s; they are
importable from here as well.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvtier.core.hashing import HashAlgo
from kvtier.core.plural import counted
from kvtier.offload.config_error import ConfigError
from kvtier.offload.config_fields import (
    CONFIG_KEYS,
    FIELD_TYPES,
    MAX_DISK_BUFFER_SLOTS,
    CascadeMode,
    DiskIOMode,
    StoreMode,
    as_enum,
    check_known_keys,
    check_type,
    valid_value,
)
from kvtier.offload.host import check_host
from kvtier.offload.plan import Tier

__all__ = [
    "CONFIG_KEYS",
    "MAX_DISK_BUFFER_SLOTS",
    "CascadeMode",
    "ConfigError",
    "DiskIOMode",
    "OffloadConfig",
    "StoreMode",
    "agree_num_tier_blocks",
    "check_known_keys",
]

logger = logging.getLogger(__name__)


_DISK_KEYS = ("disk_path", "disk_io_mode", "disk_buffer_slots", "disk_persist")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _naming_sources(
    method: Callable[Concatenate[OffloadConfig, _P], _R],
) -> Callable[Concatenate[OffloadConfig, _P], _R]:
    """Make a ConfigError that `method` raises also name the sources of the keys it names."""

    @functools.wraps(method)
    def wrapper(config: OffloadConfig, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(config, *args, **kwargs)
        except ConfigError as error:
            named = [
                f"{key} is {source}"
                for key, source in config.key_sources
                if f"{key}=" in str(error)
            ]
            if not named:
                raise
            raise ConfigError(f"{error} ({'; '.join(named)})") from None

    return wrapper


@dataclass(frozen=True)
class OffloadConfig:
    """Everything that shapes the offload scheduler and worker. Byte budgets are per rank.

    `disk_path` is a directory; each rank creates its own file in it (an empty one is
    refused with a disk tier, and taken as None without one, as `from_dict` takes it).
    It is made absolute when the config is built (`~` expanded, a relative path resolved
    against the working directory at that moment), so a later change of directory cannot
    move it. With `cpu_bytes`
    and `disk_bytes` both set the tiers form a cascade GPU → CPU → DISK (`cascade` says
    how blocks reach the disk); otherwise the one tier configured is used. `num_blocks`
    sets the size of the first lower tier explicitly (it must fit the budget); it counts
    every block of the tier pool, the null block included. `disk_persist` keeps the disk
    tier's file and a manifest across restarts (same model, layout and hash seed only).
    `token_check` records a second digest of each stored block's tokens (a token tag)
    and serves a hit only where it matches the request's own, so a hash collision costs
    a miss instead of wrong KV (SPEC §3 Beyond; eager stores only).
    `key_sources` pairs keys translated from another spelling with what the user wrote
    (e.g. `("cpu_bytes", "cpu_bytes_to_use_per_rank")`): an error on such a key names it.
    """

    cpu_bytes: int = 0
    disk_bytes: int = 0
    disk_path: str | None = None
    disk_io_mode: DiskIOMode = DiskIOMode.DIRECT
    disk_buffer_slots: int = 2
    num_blocks: int | None = None
    store_mode: StoreMode = StoreMode.EAGER
    hash_algo: HashAlgo = HashAlgo.SHA256
    hash_seed: str | None = None
    events: bool = False
    max_batched_tokens: int = 8192
    fine_grained_hits: bool = False
    eviction_policy: str = "lru"  # kvtier.core.policies.EVICTION_POLICIES
    admission_policy: str = "all"  # kvtier.core.policies.ADMISSION_POLICIES
    cascade: CascadeMode = CascadeMode.WRITE_THROUGH
    disk_persist: bool = False
    token_check: bool = False
    key_sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @_naming_sources
    def __post_init__(self) -> None:
        path = self.disk_path
        if self.disk_bytes == 0 and isinstance(path, str) and not path.strip():
            object.__setattr__(self, "disk_path", None)  # no path for no disk tier, as None
        for name in FIELD_TYPES:  # frozen: a normalized value replaces the one given
            object.__setattr__(self, name, valid_value(name, getattr(self, name)))
        if self.cpu_bytes == 0 and self.disk_bytes == 0:
            raise ConfigError("no lower tier: set cpu_bytes or disk_bytes to a positive size")
        if self.disk_bytes > 0 and not self.disk_path:
            raise ConfigError(f"disk_bytes={self.disk_bytes} needs disk_path")
        if (
            self.is_cascade
            and self.cascade is CascadeMode.WRITE_THROUGH
            and self.disk_bytes < self.cpu_bytes
        ):
            raise ConfigError(
                f"disk_bytes={self.disk_bytes} is smaller than cpu_bytes={self.cpu_bytes}: "
                "with cascade='write_through' the disk keeps a copy of every CPU block; "
                "give the disk at least cpu_bytes, or use cascade='write_back'"
            )
        if self.disk_persist and self.disk_bytes == 0:
            raise ConfigError("disk_persist=True needs a disk tier (disk_bytes > 0)")
        if self.disk_path and self.disk_bytes == 0:  # as `from_dict` warns (SPEC §8)
            logger.warning("no disk tier (disk_bytes=0): ignoring disk_path=%r", self.disk_path)
        if self.disk_persist and self.hash_algo is HashAlgo.XXHASH and self.hash_seed is None:
            raise ConfigError(
                "disk_persist=True with hash_algo='xxhash' needs a fixed hash_seed: a random "
                "seed per process would make every restart's keys differ"
            )
        if self.fine_grained_hits and self.store_mode is StoreMode.LAZY:
            raise ConfigError("fine_grained_hits=True needs store_mode='eager'")
        if self.token_check and self.store_mode is StoreMode.LAZY:
            raise ConfigError(
                "token_check=True needs store_mode='eager': a lazy store copies a block no "
                "request names, so nothing gives the tokens to check its hits against"
            )

    @property
    def is_cascade(self) -> bool:
        """Return True when CPU and disk tiers are both configured."""
        return self.cpu_bytes > 0 and self.disk_bytes > 0

    @property
    def tier(self) -> Tier:
        """Return the first lower tier: the one GPU blocks are stored into."""
        return Tier.CPU if self.cpu_bytes > 0 else Tier.DISK

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """Return the lower tiers, fastest first."""
        return (Tier.CPU, Tier.DISK) if self.is_cascade else (self.tier,)

    @staticmethod
    def from_dict(
        values: Mapping[str, Any],
        key_sources: Mapping[str, str] | None = None,
        no_disk_tier: str | None = None,
    ) -> OffloadConfig:
        """Build a config from plain values (e.g. JSON); unknown keys are rejected.

        Enum fields accept their string values in any case; `disk_direct_io` (bool) is accepted as
        the SPEC's spelling of `disk_io_mode`. Disk-only keys without a disk tier, and
        `cascade` without both tiers, are ignored with a warning, but their values are
        still checked: a typo there is an error, not a silent default. A `disk_path` that
        is None or empty agrees with having no disk tier: it is dropped without a word
        (with a disk tier an empty one is refused). The warning names
        the keys ignored and why there is no disk tier: `disk_bytes=0`, `disk_bytes`
        unset, or `no_disk_tier` (what an adapter's user wrote instead). `key_sources`
        becomes the config's `key_sources` (for values an adapter translated).
        """
        values = dict(values)
        check_known_keys(values, CONFIG_KEYS, "offload config")
        if "disk_direct_io" in values and "disk_io_mode" in values:
            raise ConfigError(
                f"disk_direct_io={values['disk_direct_io']!r} and disk_io_mode="
                f"{values['disk_io_mode']!r} both set the disk I/O mode: use one of them"
            )
        if "disk_direct_io" in values:  # SPEC §8 spelling
            direct = values.pop("disk_direct_io")
            if not isinstance(direct, bool):
                raise ConfigError(f"disk_direct_io must be a bool, got {direct!r}")
            values["disk_io_mode"] = DiskIOMode.DIRECT if direct else DiskIOMode.PAGE_CACHE
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            kwargs[key] = as_enum(key, value)
        for key in ("cpu_bytes", "disk_bytes"):  # refused before anything is ignored for them
            if key in kwargs:
                kwargs[key] = valid_value(key, kwargs[key])
        if not kwargs.get("disk_bytes"):
            path = kwargs.get("disk_path", "")
            if path is None or (isinstance(path, str) and not path.strip()):
                kwargs.pop("disk_path", None)  # no path for no disk tier: nothing ignored
            ignored = sorted(k for k in _DISK_KEYS if k in kwargs)
            for key in ignored:
                valid_value(key, kwargs[key])
            if ignored:
                if no_disk_tier is None:
                    given = "disk_bytes" in kwargs
                    no_disk_tier = f"disk_bytes={kwargs['disk_bytes']!r}" if given else None
                logger.warning(
                    "no disk tier (%s): ignoring %s",
                    no_disk_tier or "disk_bytes unset",
                    ", ".join(f"{k}={getattr(kwargs[k], 'value', kwargs[k])!r}" for k in ignored),
                )
                for key in ignored:
                    del kwargs[key]
        if "cascade" in kwargs and not (kwargs.get("cpu_bytes") and kwargs.get("disk_bytes")):
            check_type("cascade", kwargs["cascade"])
            logger.warning("cascade needs both cpu_bytes and disk_bytes: ignoring it")
            del kwargs["cascade"]
        return OffloadConfig(**kwargs, key_sources=tuple((key_sources or {}).items()))

    @_naming_sources
    def prepare_host(self) -> Path | None:
        """Check this machine can hold the tiers; create a missing `disk_path` directory.

        Returns the directory it created (None when none was): a caller whose start then
        fails removes it with `host.remove_created_directory`.

        Call where the tiers are built, before allocating them: the config itself is
        plain data and may be built on another machine. Raises ConfigError naming the
        key and value when `cpu_bytes` exceeds the machine's memory (or its container's
        limit), when `disk_path` is not a writable directory (a missing one is created
        only if its parent exists), or when `disk_bytes` exceeds the size of the
        filesystem holding `disk_path` (a budget above its free space fails when the
        tier's file is sized).
        """
        return check_host(self.cpu_bytes, self.disk_bytes, self.disk_path)

    @_naming_sources
    def num_tier_blocks(self, bytes_per_block: int, tier: Tier | None = None) -> int:
        """Return the pool size of `tier` (default: the first lower tier) (SPEC §6.1)."""
        if bytes_per_block <= 0:
            raise ConfigError(f"bytes_per_block must be > 0, got {bytes_per_block}")
        tier = self.tier if tier is None else tier
        if tier not in self.tiers:
            raise ConfigError(f"tier {tier.value} is not configured")
        budget = self.cpu_bytes if tier is Tier.CPU else self.disk_bytes
        capacity = budget // bytes_per_block
        name = "cpu_bytes" if tier is Tier.CPU else "disk_bytes"
        if self.num_blocks is not None and tier is self.tier:
            if self.num_blocks > capacity:
                raise ConfigError(
                    f"num_blocks={self.num_blocks} exceeds what {name}={budget} "
                    f"holds at {bytes_per_block} bytes per block ({capacity})"
                )
            return self.num_blocks
        if capacity < 2:
            raise ConfigError(
                f"{name}={budget} holds {counted(capacity, 'block')} of {bytes_per_block} "
                "bytes; the tier needs at least 2 (block 0 is the null block)"
            )
        return capacity


def agree_num_tier_blocks(per_worker: list[int]) -> int:
    """Return the tier size every worker can hold: the minimum over workers."""
    if not per_worker:
        raise ConfigError("no worker reported a tier size")
    return min(per_worker)
