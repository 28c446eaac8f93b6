"""`OffloadConfig.from_dict`'s SPEC spelling `disk_direct_io`, a `cascade` given without
both tiers, and the edges of `num_tier_blocks` (a mutation run on offload/config.py)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kvtier.offload.config import (
    MAX_DISK_BUFFER_SLOTS,
    CascadeMode,
    ConfigError,
    DiskIOMode,
    OffloadConfig,
)
from kvtier.offload.config_fields import FIELD_TYPES
from kvtier.offload.plan import Tier

MIB = 1 << 20
DISK = {"disk_bytes": 8 * MIB, "disk_path": "/tmp/kv"}


@pytest.mark.parametrize(
    ("direct", "mode"), [(True, DiskIOMode.DIRECT), (False, DiskIOMode.PAGE_CACHE)]
)
def test_disk_direct_io_is_the_spec_spelling_of_disk_io_mode(
    direct: bool, mode: DiskIOMode
) -> None:
    assert OffloadConfig.from_dict({**DISK, "disk_direct_io": direct}).disk_io_mode is mode


@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_disk_direct_io_must_be_a_bool(value: object) -> None:
    """A string or a number is refused, not read as true: `"false"` would be direct I/O."""
    with pytest.raises(ConfigError, match=f"disk_direct_io must be a bool, got {value!r}"):
        OffloadConfig.from_dict({**DISK, "disk_direct_io": value})


def test_a_cascade_mode_without_a_cpu_tier_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A disk-only config has no cascade: its `cascade` is ignored as without a disk tier."""
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        config = OffloadConfig.from_dict({**DISK, "cascade": "write_back"})
    assert [r.getMessage() for r in caplog.records] == [
        "cascade needs both cpu_bytes and disk_bytes: ignoring it"
    ]
    assert config.tiers == (Tier.DISK,)
    assert config.cascade is CascadeMode.WRITE_THROUGH  # the default, as if not given


def test_a_block_size_of_zero_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="bytes_per_block must be > 0, got 0"):
        OffloadConfig(cpu_bytes=MIB).num_tier_blocks(0)


@pytest.mark.parametrize("tier", [Tier.DISK, Tier.GPU])
def test_only_a_configured_tier_is_sized(tier: Tier) -> None:
    with pytest.raises(ConfigError, match=f"tier {tier.value} is not configured"):
        OffloadConfig(cpu_bytes=MIB).num_tier_blocks(1024, tier)
    with pytest.raises(ConfigError, match=f"tier {Tier.CPU.value} is not configured"):
        OffloadConfig(**DISK).num_tier_blocks(1024, Tier.CPU)  # type: ignore[arg-type]


def test_num_blocks_sizes_the_first_lower_tier_only() -> None:
    """In a cascade `num_blocks` is the CPU tier's size; the disk tier is sized by its bytes."""
    config = OffloadConfig(cpu_bytes=4 * MIB, num_blocks=3, **DISK)  # type: ignore[arg-type]
    assert config.num_tier_blocks(MIB) == 3
    assert config.num_tier_blocks(MIB, Tier.CPU) == 3
    assert config.num_tier_blocks(MIB, Tier.DISK) == 8
    assert OffloadConfig(num_blocks=3, **DISK).num_tier_blocks(MIB) == 3  # type: ignore[arg-type]


def test_a_tier_too_small_is_named_by_its_own_budget() -> None:
    config = OffloadConfig(cpu_bytes=4096, cascade=CascadeMode.WRITE_BACK, **DISK)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=f"^disk_bytes={8 * MIB} holds 1 block of {8 * MIB} "):
        config.num_tier_blocks(8 * MIB, Tier.DISK)


def test_the_disk_keys_ignored_are_named_in_order(caplog: pytest.LogCaptureFixture) -> None:
    values = {"disk_path": "/tmp/kv", "disk_io_mode": "direct", "disk_buffer_slots": 4}
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        OffloadConfig.from_dict({"cpu_bytes": MIB, "disk_persist": False, **values})
    assert [r.getMessage() for r in caplog.records] == [
        "no disk tier (disk_bytes unset): ignoring disk_buffer_slots=4, disk_io_mode='direct', "
        "disk_path='/tmp/kv', disk_persist=False"
    ]


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"memory": 1}, "memory (keys like it: cpu_bytes, disk_bytes); valid keys: "),
        ({"HOST_MEMORY": 1}, "HOST_MEMORY (keys like it: cpu_bytes); valid keys: "),
        ({"cpu_bytes": MIB, "CPU_BYTES": 1}, "CPU_BYTES (looks like 'cpu_bytes', which is "),
    ],
)
def test_a_size_key_is_hinted_at_the_byte_sizes_of_its_own_tier(
    values: dict[str, object], named: str
) -> None:
    """A size word alone names both tiers' sizes; a key in capitals is read as lower case
    (`HOST_MEMORY` is the CPU tier's size, `CPU_BYTES` beside cpu_bytes repeats it)."""
    with pytest.raises(ConfigError) as refused:
        OffloadConfig.from_dict(values)
    assert named in str(refused.value)


@pytest.mark.parametrize(
    ("given", "misspelt", "twin"),
    [
        ({"cpu_bytes": MIB}, "pcu_bytes", "cpu_bytes"),  # was offered disk_bytes
        ({"disk_bytes": MIB}, "dsik_bytes", "disk_bytes"),  # was offered cpu_bytes
        (DISK, "disk_pat", "disk_path"),  # was offered disk_persist
    ],
)
def test_a_misspelt_key_closest_to_a_key_given_is_said_to_repeat_it(
    given: dict[str, object], misspelt: str, twin: str
) -> None:
    """(s31, SPEC §9 scenario 27) A misspelt key whose closest valid key is given beside
    it most likely repeats that key by a typo: the message says so, and offers no
    runner-up (another setting: `pcu_bytes` beside cpu_bytes was offered the disk tier's
    size), nor lists the keys."""
    named = f"{misspelt} (looks like {twin!r}, which is given already)"
    with pytest.raises(ConfigError, match=f"^unknown offload config key: {re.escape(named)}$"):
        OffloadConfig.from_dict({**given, misspelt: MIB})


@pytest.mark.parametrize(
    "name", sorted(set(FIELD_TYPES) - {"disk_path", "num_blocks", "hash_seed"})
)
def test_none_is_refused_for_a_field_that_is_not_optional(name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} must be .*, got None$"):
        OffloadConfig.from_dict({"cpu_bytes": MIB, **DISK, name: None})


def test_disk_buffer_slots_are_bounded_at_the_maximum_itself() -> None:
    config = OffloadConfig(**DISK, disk_buffer_slots=MAX_DISK_BUFFER_SLOTS)  # type: ignore[arg-type]
    assert config.disk_buffer_slots == MAX_DISK_BUFFER_SLOTS
    with pytest.raises(ConfigError, match=f"disk_buffer_slots={MAX_DISK_BUFFER_SLOTS + 1} is"):
        OffloadConfig(**DISK, disk_buffer_slots=MAX_DISK_BUFFER_SLOTS + 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [1, None])
def test_a_key_that_is_not_a_str_is_named_as_unknown(key: object) -> None:
    with pytest.raises(ConfigError, match=f"^unknown offload config key: {key}; valid keys: "):
        OffloadConfig.from_dict({key: MIB})  # type: ignore[dict-item]


def test_a_path_object_is_taken_for_disk_path_only() -> None:
    with pytest.raises(ConfigError, match=r"hash_seed must be a str, got .*Path\('seed'\)"):
        OffloadConfig(cpu_bytes=MIB, hash_seed=Path("seed"))  # type: ignore[arg-type]
