"""`kv_connector_extra_config` → `OffloadConfig` (pure Python: runs without vLLM)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kvtier.adapters.vllm.config import offload_config_from_vllm
from kvtier.offload.config import CascadeMode, ConfigError, DiskIOMode, OffloadConfig, StoreMode
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


@pytest.mark.parametrize(
    ("policy", "eviction", "admission"),
    [("arc", "arc", "all"), ("S3FIFO", "s3fifo", "all"), ("lfuda+door", "lfuda", "door")],
)
def test_any_kvtier_policy_maps_to_eviction_and_admission(
    policy: str, eviction: str, admission: str
) -> None:
    config = convert({"cpu_bytes": GIB, "policy": policy})
    assert (config.eviction_policy, config.admission_policy) == (eviction, admission)
    split = convert({"cpu_bytes": GIB, "eviction_policy": eviction, "admission_policy": admission})
    assert (split.eviction_policy, split.admission_policy) == (eviction, admission)


def test_split_policy_keys_ignore_case_as_policy_does() -> None:
    """Regression: "policy": "ARC" was accepted, "eviction_policy": "ARC" refused."""
    config = convert({"cpu_bytes": GIB, "eviction_policy": "ARC", "admission_policy": " Door "})
    assert (config.eviction_policy, config.admission_policy) == ("arc", "door")


@pytest.mark.parametrize("mode", ["write_through", "write_back"])
def test_cpu_and_disk_bytes_form_a_cascade(mode: str) -> None:
    extra = {"cpu_bytes": GIB, "disk_bytes": 4 * GIB, "disk_path": "/tmp/kv", "cascade": mode}
    config = convert(extra)
    assert config.is_cascade
    assert config.tiers == (Tier.CPU, Tier.DISK)
    assert config.cascade is CascadeMode(mode)
    default = convert({"cpu_bytes": GIB, "disk_bytes": GIB, "disk_path": "/tmp/kv"})
    assert default.cascade is CascadeMode.WRITE_THROUGH


@pytest.mark.parametrize("backend", ["cascade", "cpu+disk"])
def test_simple_offload_cascade_backend_sizes_both_tiers(backend: str) -> None:
    extra = {
        "kv_offload_backend": backend,
        "cpu_bytes_to_use": 8 * GIB,
        "disk_capacity_bytes": 16 * GIB,
        "disk_path": "/tmp/kv",
        "use_page_cache": True,
        "cascade": "write_back",
    }
    config = convert(extra, world_size=2)
    assert (config.cpu_bytes, config.disk_bytes) == (4 * GIB, 16 * GIB)
    assert (config.cascade, config.disk_io_mode) == (CascadeMode.WRITE_BACK, DiskIOMode.PAGE_CACHE)
    per_rank = convert({**extra, "cpu_bytes_to_use_per_rank": 3 * GIB}, world_size=2)
    assert per_rank.cpu_bytes == 3 * GIB
    defaults = convert({"kv_offload_backend": backend, "disk_path": "/tmp/kv"})
    assert (defaults.cpu_bytes, defaults.disk_bytes) == (8 * GIB, 100 * GIB)


def test_disk_persist_false_is_accepted() -> None:
    extra = {"disk_bytes": GIB, "disk_path": "/tmp/kv", "disk_persist": False}
    assert not convert(extra).disk_persist


def test_simple_offload_cpu_budget_is_split_over_ranks() -> None:
    assert convert({"cpu_bytes_to_use": 8 * GIB}, world_size=4).cpu_bytes == 2 * GIB
    per_rank = {"cpu_bytes_to_use": 8 * GIB, "cpu_bytes_to_use_per_rank": 3 * GIB}
    assert convert(per_rank, world_size=4).cpu_bytes == 3 * GIB
    assert convert({"lazy_offload": True}, world_size=2).cpu_bytes == 4 * GIB  # its default
    assert convert({"cpu_bytes_to_use": 4}, world_size=4).cpu_bytes == 1  # the least: 1 each


def test_simple_offload_keys_map_to_kvtier_settings() -> None:
    config = convert({"num_cpu_blocks": 100, "lazy_offload": True, "cpu_bytes_to_use": GIB})
    assert (config.num_blocks, config.store_mode) == (100, StoreMode.LAZY)
    disk = convert({"kv_offload_backend": "disk", "disk_path": "/tmp/kv", "use_page_cache": True})
    assert (disk.tier, disk.disk_bytes, disk.disk_path) == (Tier.DISK, 100 * GIB, "/tmp/kv")
    assert disk.disk_io_mode is DiskIOMode.PAGE_CACHE


@pytest.mark.parametrize("key", ["disk_capacity_bytes", "use_page_cache"])
def test_simple_offload_disk_keys_without_a_disk_backend_are_named_when_ignored(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    value = {"disk_capacity_bytes": 500 * GIB, "use_page_cache": True}[key]
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        config = convert({"cpu_bytes_to_use": 8 * GIB, key: value})
    assert (config.tier, config.disk_bytes) == (Tier.CPU, 0)
    assert [r.getMessage() for r in caplog.records] == [
        f'kv_offload_backend="cpu" has no disk tier: ignoring {key} (set kv_offload_backend '
        'to "disk" or "cascade" for one)'
    ]  # not silent, and not under a kvtier name the config does not contain (disk_io_mode)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes": GIB, "hash_algo": "xxhash"}, "hash_algo"),
        ({"cpu_bytes": GIB, "events": True}, "events"),
        ({"cpu_bytes": GIB, "max_batched_tokens": 8}, "max_batched_tokens"),
        ({"cpu_bytes": GIB, "cpu_bytes_to_use": GIB}, "use one spelling"),
        ({"num_blocks": 4, "num_cpu_blocks": 8}, r"num_blocks mixed with .* \(num_cpu_blocks\)"),
        ({"store_mode": "lazy", "lazy_offload": False}, r"store_mode mixed with .*lazy_offload"),
        ({"kv_offload_backend": "tape"}, "kv_offload_backend must be one of"),
        ({"lazy_offload": "yes"}, "lazy_offload"),
        ({"use_page_cache": "yes"}, "use_page_cache must be a bool"),
        ({"cpu_bytes_to_use": "8G"}, "cpu_bytes_to_use"),
        ({"cpu_bytes": GIB, "bogus": 1}, "bogus"),
        ({"cpu_bytes": GIB, "policy": "lru+"}, "missing admission"),
        ({"cpu_bytes": GIB, "policy": "mru"}, "unknown eviction policy 'mru'"),
        ({"cpu_bytes": GIB, "policy": "lru+bouncer"}, "unknown admission policy 'bouncer'"),
        ({"cpu_bytes": GIB, "policy": 1}, "policy must be a string"),
        ({"cpu_bytes": GIB, "policy": "arc", "eviction_policy": "lru"}, "use one spelling"),
        ({"cpu_bytes": GIB, "eviction_policy": "mru"}, "eviction_policy='mru' is invalid"),
        ({"cpu_bytes": GIB, "cascade": True}, "cascade must be one of"),
        ({"cpu_bytes": GIB, "cascade": "write_around"}, "cascade must be one of"),
        (
            {"cpu_bytes": 2 * GIB, "disk_bytes": GIB, "disk_path": "/tmp"},
            "disk_bytes=1073741824 is smaller than cpu_bytes",
        ),
        ({"cpu_bytes": GIB, "disk_bytes": GIB}, "needs disk_path"),
        ({"kv_offload_backend": "cascade"}, "needs disk_path"),
        (
            {"cpu_bytes": GIB, "disk_bytes": GIB, "disk_path": "/tmp", "disk_persist": True},
            "disk_persist=True is not supported by the vLLM connector.*reference engine only",
        ),
        ({"disk_bytes": GIB, "disk_path": "/tmp", "disk_persist": 1}, "disk_persist must be"),
        ({"cpu_bytes": GIB, "store_mode": "sometimes"}, "store_mode"),
    ],
)
def test_bad_keys_are_rejected_by_name(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        convert(extra)


@pytest.mark.parametrize(
    ("key", "how"),
    [
        ("events", "enable KV events in vLLM (kv_events_config.enable_kv_cache_events)"),
        ("max_batched_tokens", "vLLM's --max-num-batched-tokens is used"),
        ("hash_algo", "vLLM hashes the blocks: set --prefix-caching-hash-algo"),
        ("hash_seed", "vLLM hashes the blocks: set PYTHONHASHSEED"),
    ],
)
def test_a_setting_vllm_owns_is_refused_saying_where_to_set_it(key: str, how: str) -> None:
    """Not merely "unknown key": the key is kvtier's, but vLLM sets it for the connector."""
    with pytest.raises(ConfigError) as error:
        convert({"cpu_bytes": GIB, key: 1})
    assert str(error.value) == f"{key} cannot be set in kv_connector_extra_config: {how}"


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("cpu_byte", "cpu_bytes_to_use"),  # cpu_bytes would be refused with num_cpu_blocks
        ("cpu_bytes_to_us", "cpu_bytes_to_use"),
        ("polcy", "policy"),
    ],
)
def test_an_unknown_key_names_its_origin_and_the_closest_key(key: str, suggestion: str) -> None:
    """Regression: 'unknown offload config key(s): cpu_byte' named neither."""
    with pytest.raises(ConfigError) as error:
        convert({"num_cpu_blocks": 10, key: 1})
    assert str(error.value) == (
        f"unknown kv_connector_extra_config key: {key} (did you mean {suggestion!r}?)"
    )


def test_an_unknown_key_is_never_steered_to_a_setting_vllm_owns() -> None:
    with pytest.raises(ConfigError, match=r"key: hash_sed; keys valid") as error:
        convert({"cpu_bytes": GIB, "hash_sed": "0"})
    assert "hash_seed" not in str(error.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"disk_io_mode": "page_cache", "disk_direct_io": True}, "disk_direct_io=True"),
        ({"disk_io_mode": "direct", "disk_direct_io": False}, "disk_direct_io=False"),
        ({"use_page_cache": True, "disk_io_mode": "direct"}, "use_page_cache=True"),
        ({"use_page_cache": False, "disk_direct_io": False}, "disk_direct_io=False"),
    ],
)
def test_two_disk_io_keys_are_refused_naming_both(extra: dict[str, object], message: str) -> None:
    disk = {"kv_offload_backend": "disk"} if "use_page_cache" in extra else {"disk_bytes": GIB}
    with pytest.raises(ConfigError, match=f"{message}.* both set the disk I/O mode"):
        convert({**disk, "disk_path": "/tmp/kv", **extra})
    mixed = {"kv_offload_backend": "disk", "disk_path": "/tmp/kv", "disk_io_mode": "page_cache"}
    assert convert(mixed).disk_io_mode is DiskIOMode.PAGE_CACHE  # one key, either spelling


@pytest.mark.parametrize(
    ("extra", "message", "translated"),
    [
        ({"cpu_bytes_to_use": -8}, "cpu_bytes_to_use=-8 is invalid", "cpu_bytes="),
        ({"cpu_bytes_to_use": 3}, "cpu_bytes_to_use=3 is invalid.* 4 ranks", "no lower tier"),
        ({"cpu_bytes_to_use_per_rank": 0}, "cpu_bytes_to_use_per_rank=0 is invalid", "cpu_bytes="),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks=0 is invalid", "num_blocks"),
        ({"num_cpu_blocks": "7.0"}, "num_cpu_blocks must be an int, got '7.0'", "num_blocks"),
        (
            {"kv_offload_backend": "disk", "disk_path": "/tmp", "disk_capacity_bytes": -1},
            "disk_capacity_bytes=-1 is invalid",
            "disk_bytes",
        ),
        ({"disk_capacity_bytes": 1.5}, "disk_capacity_bytes must be a whole number", "disk_bytes"),
        ({"cpu_bytes_to_use": 8.5}, "cpu_bytes_to_use must be a whole number", "cpu_bytes="),
        ({"cpu_bytes_to_use": float("nan")}, "cpu_bytes_to_use must be a whole", "cpu_bytes="),
        ({"cpu_bytes_to_use_per_rank": "8GB"}, "must be an int, got '8GB'", "cpu_bytes="),
        ({"cpu_bytes_to_use_per_rank": True}, "per_rank must be an int, got True", "cpu_bytes "),
        ({"cpu_bytes_to_use": False}, "cpu_bytes_to_use must be an int, got False", "cpu_bytes="),
        ({"num_cpu_blocks": 1}, "num_cpu_blocks=1 is invalid: must be >= 2", "num_blocks"),
    ],
)
def test_simple_offload_values_are_refused_under_their_own_names(
    extra: dict[str, object], message: str, translated: str
) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        convert(extra, world_size=4)
    assert translated not in str(error.value)  # kvtier's name for the setting


@pytest.mark.parametrize(
    ("extra", "sources"),
    [
        ({"kv_offload_backend": "disk"}, "(disk_bytes is disk_capacity_bytes's default)"),
        (
            {"kv_offload_backend": "cascade", "cpu_bytes_to_use_per_rank": 200 * GIB},
            "(cpu_bytes is cpu_bytes_to_use_per_rank; disk_bytes is disk_capacity_bytes's default)",
        ),
        (
            {
                "kv_offload_backend": "cascade",
                "cpu_bytes_to_use": 8 * GIB,
                "disk_capacity_bytes": GIB,
            },
            "(cpu_bytes is cpu_bytes_to_use / 4 ranks; disk_bytes is disk_capacity_bytes)",
        ),
        ({"lazy_offload": True, "fine_grained_hits": True}, "(store_mode is lazy_offload)"),
    ],
)
def test_errors_on_translated_values_name_the_simple_offload_keys(
    extra: dict[str, object], sources: str
) -> None:
    path = {"disk_path": "/tmp/kv"} if extra.get("kv_offload_backend") == "cascade" else {}
    with pytest.raises(ConfigError, match=re.escape(sources) + "$"):
        convert({**extra, **path}, world_size=4)


def test_host_checks_name_the_simple_offload_keys(tmp_path: Path) -> None:
    """Regression: 'cpu_bytes=... exceeds this machine's memory' named an unwritten key."""
    with pytest.raises(ConfigError, match=r"memory.*\(cpu_bytes is cpu_bytes_to_use_per_rank\)$"):
        convert({"cpu_bytes_to_use_per_rank": 1 << 60}).prepare_host()
    disk = {"kv_offload_backend": "disk", "disk_capacity_bytes": 1 << 62}
    with pytest.raises(ConfigError, match=r"filesystem.*\(disk_bytes is disk_capacity_bytes\)$"):
        convert({**disk, "disk_path": str(tmp_path)}).prepare_host()
    with pytest.raises(ConfigError, match=r"memory.*bytes\)$"):  # kvtier's own keys: as written
        convert({"cpu_bytes": 1 << 60}).prepare_host()


def test_tier_sizing_names_the_simple_offload_keys() -> None:
    """The worker sizes the tiers (`num_tier_blocks`): its errors name the keys written."""
    config = convert({"cpu_bytes_to_use": 4 * GIB, "num_cpu_blocks": 1 << 20}, world_size=4)
    sources = "(cpu_bytes is cpu_bytes_to_use / 4 ranks; num_blocks is num_cpu_blocks)"
    with pytest.raises(ConfigError, match=r"^num_blocks=.* " + re.escape(sources) + "$"):
        config.num_tier_blocks(4096)
    one_block = convert({"cpu_bytes_to_use": 4 * GIB}, world_size=4)
    with pytest.raises(ConfigError, match=re.escape("(cpu_bytes is cpu_bytes_to_use / 4 ranks)")):
        one_block.num_tier_blocks(GIB)


@pytest.mark.parametrize("spelling", [8e9, "8000000000", " 8000000000 "])
def test_vllm_byte_keys_are_read_as_vllm_reads_them(spelling: object) -> None:
    """vLLM's own connector takes `int(value)`: a JSON 8e9 or a digit string is a byte
    count there, so the same config works with kvtier (a fraction is refused, not cut)."""
    assert convert({"cpu_bytes_to_use": spelling}, world_size=4).cpu_bytes == 2_000_000_000
    per_rank = convert({"cpu_bytes_to_use_per_rank": spelling}, world_size=4)
    assert per_rank.cpu_bytes == 8_000_000_000
    disk = {"kv_offload_backend": "disk", "disk_path": "/tmp/kv"}
    assert convert({**disk, "disk_capacity_bytes": spelling}).disk_bytes == 8_000_000_000
