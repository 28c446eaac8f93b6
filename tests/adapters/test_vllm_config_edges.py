"""Config values a review found accepted and failing later, or resolved silently
(pure Python: runs without vLLM). Each named value is refused at start-up, naming the
key, or warned of as vLLM's own connector does."""

from __future__ import annotations

import logging

import pytest

from kvtier.adapters.vllm.config import offload_config_from_vllm
from kvtier.core.policies import PolicySpec
from kvtier.offload.config import CascadeMode, ConfigError, OffloadConfig

GIB = 1024**3
DISK = {"cpu_bytes": GIB, "disk_bytes": GIB, "disk_path": "/tmp"}


def convert(extra: dict[str, object], world_size: int = 1) -> OffloadConfig:
    return offload_config_from_vllm(extra, world_size, max_batched_tokens=2048, events=False)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # Regression: 10**9 staging buffers of 4 MiB each: killed for memory, no message.
        ({**DISK, "disk_buffer_slots": 65}, r"disk_buffer_slots=65 is invalid: must be <= 64"),
        # Regression: accepted, then `ValueError: embedded null byte` naming no key.
        ({**DISK, "disk_path": "/tmp/a\x00b"}, "disk_path=.* a path cannot hold a NUL"),
        # Regression: "disk_bytes=1073741824 needs disk_path", as if it were not given.
        ({**DISK, "disk_path": ""}, r"disk_path='' is invalid: it is empty; give the dir"),
        ({"kv_offload_backend": "disk", "disk_path": ""}, r"disk_path='' is invalid: it is empty"),
        # Regression: taken as a directory named by three spaces in the working directory.
        ({**DISK, "disk_path": "   "}, r"disk_path='   ' is invalid: it is empty"),
        # Regression: "choose one of lru, arc, ...", not where 'lru+door' goes.
        (
            {**DISK, "eviction_policy": "lru+door"},
            r"eviction_policy='lru\+door' is invalid: eviction_policy takes one of lru, arc, "
            r".*; give an 'EVICTION\+ADMISSION' name as policy='lru\+door'",
        ),
        ({**DISK, "admission_policy": "lru+door"}, r"takes one of all, door; .* as policy="),
    ],
)
def test_values_that_failed_late_are_refused_naming_the_key(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        convert(extra)


def test_a_combined_policy_name_in_a_policy_field_says_how_to_split_it() -> None:
    """Regression: OffloadConfig's eviction_policy='lru+door' listed the eviction policies
    only; it now also names the two fields the halves go in."""
    with pytest.raises(ConfigError, match=r"admission_policy='door'"):
        OffloadConfig.from_dict({**DISK, "eviction_policy": "LRU + door"})
    with pytest.raises(ConfigError, match=r"disk_path='' is invalid: it is empty"):
        OffloadConfig(cpu_bytes=GIB, disk_bytes=GIB, disk_path="")


def test_an_empty_hash_seed_is_refused_naming_the_key() -> None:
    """Regression: accepted, then the engine failed with 'hash seed must not be empty'.

    The message said unset meant "a random seed per process", true of xxhash only: with
    the default sha256 an unset seed is the fixed public one (hashes match across runs).
    """
    with pytest.raises(ConfigError, match="hash_seed='' is invalid: must not be empty") as err:
        OffloadConfig(cpu_bytes=GIB, hash_seed="")
    assert "sha256's fixed public seed" in str(err.value)


@pytest.mark.parametrize(("direct", "mode"), [(False, "direct"), (True, "page_cache")])
def test_two_disk_io_keys_are_refused_by_from_dict_too(direct: bool, mode: str) -> None:
    """Regression: `disk_direct_io` silently won over `disk_io_mode`."""
    values = {**DISK, "disk_direct_io": direct, "disk_io_mode": mode}
    with pytest.raises(ConfigError, match="both set the disk I/O mode"):
        OffloadConfig.from_dict(values)


def test_cascade_ignores_case_like_the_other_names() -> None:
    """Regression: "Write_Back" was refused by the connector, accepted by from_dict."""
    assert convert({**DISK, "cascade": "Write_Back"}).cascade is CascadeMode.WRITE_BACK
    assert convert({**DISK, "cascade": " write_back "}).cascade is CascadeMode.WRITE_BACK


def test_policy_parts_ignore_spaces_around_the_plus() -> None:
    assert PolicySpec.parse(" LRU + door ").name == "lru+door"


def test_an_unknown_key_in_another_case_names_the_key_it_looks_like() -> None:
    with pytest.raises(ConfigError, match=r"CPU_BYTES \(did you mean 'cpu_bytes'\?\)"):
        convert({"CPU_BYTES": GIB})


@pytest.mark.parametrize(
    ("extra", "warning"),
    [
        (
            {"cpu_bytes_to_use": GIB, "cpu_bytes_to_use_per_rank": GIB // 4},
            "cpu_bytes_to_use_per_rank=268435456 != cpu_bytes_to_use / 2 ranks = 536870912"
            ": using cpu_bytes_to_use_per_rank",
        ),
        (
            {"kv_offload_backend": "disk", "disk_path": "/tmp", "cpu_bytes_to_use": GIB},
            'kv_offload_backend="disk" has no CPU tier: ignoring cpu_bytes_to_use',
        ),
    ],
)
def test_simple_offload_cpu_sizes_not_used_as_written_are_warned_of(
    extra: dict[str, object], warning: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: both were dropped without a word (vLLM's connector warns of the first)."""
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        convert(extra, world_size=2)
    assert any(warning in record.getMessage() for record in caplog.records), caplog.text


@pytest.mark.parametrize(
    ("extra", "world_size"),
    [
        ({"cpu_bytes_to_use": 8 * GIB, "cpu_bytes_to_use_per_rank": 2 * GIB}, 4),
        ({"kv_offload_backend": "disk", "disk_capacity_bytes": GIB, "use_page_cache": True}, 1),
        ({"kv_offload_backend": "cascade", "disk_capacity_bytes": 9 * GIB}, 2),
        ({"kv_offload_backend": "cascade", "use_page_cache": False, "cpu_bytes_to_use": GIB}, 2),
    ],
)
def test_simple_offload_sizes_used_as_written_are_not_warned_of(
    extra: dict[str, object], world_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A per-rank size that is the total's share, and the disk keys with a backend that
    has a disk tier, are used as written: no warning says otherwise."""
    disk_path = {"disk_path": "/tmp"} if "kv_offload_backend" in extra else {}
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        convert({**extra, **disk_path}, world_size)
    assert caplog.records == []


def test_the_offload_backend_ignores_case_like_the_other_names() -> None:
    config = convert({"kv_offload_backend": " CASCADE ", "disk_path": "/tmp"})
    assert config.is_cascade


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"cpu_bytes": GIB, "disk_bytes": 0, "disk_path": "/tmp/kv"}, "disk_bytes=0"),
        ({"cpu_bytes": GIB, "disk_path": "/tmp/kv"}, "disk_bytes unset"),
        ({"cpu_bytes_to_use": GIB, "disk_path": "/tmp/kv"}, "kv_offload_backend='cpu'"),
        ({"kv_offload_backend": "CPU", "disk_path": "/tmp/kv"}, "kv_offload_backend='CPU'"),
    ],
)
def test_a_disk_path_without_a_disk_tier_is_warned_of_naming_why(
    extra: dict[str, object], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §8: disk keys without a disk tier are ignored with a warning (a deployment may
    switch its disk tier off with disk_bytes=0 and keep the rest), which names the key
    that turned the tier off as the user wrote it. Regression: it said "disk_bytes is 0
    or unset" also for a config written with kv_offload_backend, which has no disk_bytes."""
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        config = convert(extra)
    assert (config.disk_bytes, config.disk_path) == (0, None)
    assert [r.getMessage() for r in caplog.records] == [
        f"no disk tier ({why}): ignoring disk_path='/tmp/kv'"
    ]


def test_the_per_rank_warning_on_one_rank_says_rank(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: "cpu_bytes_to_use / 1 rank(s)"."""
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        convert({"cpu_bytes_to_use": GIB, "cpu_bytes_to_use_per_rank": GIB // 4})
    assert "cpu_bytes_to_use / 1 rank = 1073741824: using" in caplog.text, caplog.text
