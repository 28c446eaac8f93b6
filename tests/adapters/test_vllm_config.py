"""`kv_connector_extra_config` → `OffloadConfig` (pure Python: runs without vLLM)."""

from __future__ import annotations

import pytest

from kvtier.adapters.vllm.config import offload_config_from_vllm
from kvtier.offload.config import ConfigError, DiskIOMode, OffloadConfig, StoreMode
from kvtier.offload.plan import Tier

GIB = 1024**3


def convert(extra: dict[str, object], world_size: int = 1, events: bool = False) -> OffloadConfig:
    return offload_config_from_vllm(extra, world_size, max_batched_tokens=2048, events=events)


def test_kvtier_keys_pass_through_with_vllm_owned_settings() -> None:
    config = convert({"cpu_bytes": 4 * GIB, "store_mode": "lazy"}, events=True)
    assert (config.tier, config.cpu_bytes, config.store_mode) == (Tier.CPU, 4 * GIB, StoreMode.LAZY)
    assert config.max_batched_tokens == 2048
    assert config.events


def test_lru_policy_is_accepted() -> None:
    assert convert({"cpu_bytes": GIB, "policy": " LRU "}).cpu_bytes == GIB


def test_simple_offload_cpu_budget_is_split_over_ranks() -> None:
    assert convert({"cpu_bytes_to_use": 8 * GIB}, world_size=4).cpu_bytes == 2 * GIB
    per_rank = {"cpu_bytes_to_use": 8 * GIB, "cpu_bytes_to_use_per_rank": 3 * GIB}
    assert convert(per_rank, world_size=4).cpu_bytes == 3 * GIB
    assert convert({"lazy_offload": True}, world_size=2).cpu_bytes == 4 * GIB  # its default


def test_simple_offload_keys_map_to_kvtier_settings() -> None:
    config = convert({"num_cpu_blocks": 100, "lazy_offload": True, "cpu_bytes_to_use": GIB})
    assert (config.num_blocks, config.store_mode) == (100, StoreMode.LAZY)
    disk = convert({"kv_offload_backend": "disk", "disk_path": "/tmp/kv", "use_page_cache": True})
    assert (disk.tier, disk.disk_bytes, disk.disk_path) == (Tier.DISK, 100 * GIB, "/tmp/kv")
    assert disk.disk_io_mode is DiskIOMode.PAGE_CACHE


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes": GIB, "hash_algo": "xxhash"}, "hash_algo"),
        ({"cpu_bytes": GIB, "events": True}, "events"),
        ({"cpu_bytes": GIB, "max_batched_tokens": 8}, "max_batched_tokens"),
        ({"cpu_bytes": GIB, "cpu_bytes_to_use": GIB}, "use one spelling"),
        ({"kv_offload_backend": "tape"}, "kv_offload_backend"),
        ({"lazy_offload": "yes"}, "lazy_offload"),
        ({"cpu_bytes_to_use": "8G"}, "cpu_bytes_to_use"),
        ({"cpu_bytes": GIB, "bogus": 1}, "bogus"),
        ({"cpu_bytes": GIB, "policy": "arc"}, "policy='arc' is not available"),
        ({"cpu_bytes": GIB, "policy": "lru+"}, "missing admission"),
        ({"cpu_bytes": GIB, "policy": "mru"}, "unknown eviction policy 'mru'"),
        ({"cpu_bytes": GIB, "policy": 1}, "policy must be a string"),
        ({"cpu_bytes": GIB, "cascade": True}, "cascade is not available yet"),
        ({"kv_offload_backend": "cpu+disk"}, "cascade is not available yet"),
        ({"cpu_bytes": GIB, "disk_bytes": GIB, "disk_path": "/tmp"}, "cascade"),
        ({"cpu_bytes": GIB, "store_mode": "sometimes"}, "store_mode"),
    ],
)
def test_bad_keys_are_rejected_by_name(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        convert(extra)
