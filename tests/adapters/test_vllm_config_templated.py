"""Config values as shell or helm templating writes them (pure Python: runs without vLLM).

A templated `--kv-transfer-config` often carries an empty value for a tier left out
(`"disk_path": ""`, `"disk_capacity_bytes": 0`) and numbers as strings (`"4"`). Where
that is unambiguous kvtier takes it as vLLM's own connectors do (they read sizes with
`int()` and an empty `disk_path` as none); what would change behaviour silently stays
refused, naming the key and the value.
"""

from __future__ import annotations

import logging
import re

import pytest
from test_vllm_config_edges import GIB, convert

from kvtier.offload.config import ConfigError, OffloadConfig
from kvtier.offload.plan import Tier

DISK = {"cpu_bytes": GIB, "disk_bytes": GIB, "disk_path": "/tmp/kv"}


@pytest.mark.parametrize(
    ("extra", "tiers"),
    [
        ({"cpu_bytes": GIB, "disk_path": ""}, (Tier.CPU,)),
        ({"cpu_bytes": GIB, "disk_bytes": 0, "disk_path": ""}, (Tier.CPU,)),
        ({"cpu_bytes": GIB, "disk_bytes": "0", "disk_path": "  "}, (Tier.CPU,)),
        ({"cpu_bytes": GIB, "disk_path": None}, (Tier.CPU,)),
        ({"cpu_bytes_to_use": GIB, "disk_path": ""}, (Tier.CPU,)),
        ({"cpu_bytes_to_use": GIB, "disk_path": None}, (Tier.CPU,)),
        ({"cpu_bytes_to_use": GIB, "disk_capacity_bytes": 0, "disk_path": ""}, (Tier.CPU,)),
        ({"kv_offload_backend": "cpu", "disk_capacity_bytes": "0"}, (Tier.CPU,)),
        (
            {"kv_offload_backend": "disk", "disk_path": "/tmp/kv", "cpu_bytes_to_use": 0},
            (Tier.DISK,),
        ),
        (
            {"kv_offload_backend": "disk", "disk_path": "/tmp/kv", "cpu_bytes_to_use_per_rank": 0},
            (Tier.DISK,),
        ),
    ],
)
def test_an_empty_value_for_a_tier_left_out_is_taken_without_a_word(
    extra: dict[str, object], tiers: tuple[Tier, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: `disk_path=""` and `disk_capacity_bytes=0` were refused with no disk
    tier (the empty value agrees with it), and `disk_path=None` warned "ignoring
    disk_path=None"; a zero CPU size with the disk backend was refused likewise."""
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        config = convert(extra)
    assert config.tiers == tiers
    assert config.disk_path == (None if tiers == (Tier.CPU,) else "/tmp/kv")
    assert caplog.records == []


def test_from_dict_takes_an_empty_disk_path_without_a_disk_tier_as_none() -> None:
    config = OffloadConfig.from_dict({"cpu_bytes": GIB, "disk_path": ""})
    assert (config.disk_bytes, config.disk_path) == (0, None)
    with pytest.raises(ConfigError, match=r"disk_path='' is invalid: it is empty"):
        OffloadConfig.from_dict({"disk_bytes": GIB, "disk_path": ""})  # a tier needs one


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"kv_offload_backend": "cascade", "disk_path": "/tmp", "disk_capacity_bytes": 0},
            "disk_capacity_bytes=0 is invalid: kv_offload_backend='cascade' has a disk tier, "
            "which needs at least 1 byte (for none, set kv_offload_backend to 'cpu')",
        ),
        (
            {"kv_offload_backend": "disk", "disk_path": "/tmp", "disk_capacity_bytes": "0"},
            "disk_capacity_bytes=0 is invalid: kv_offload_backend='disk' has a disk tier",
        ),
        (
            {"cpu_bytes_to_use": 0},
            "cpu_bytes_to_use=0 is invalid: kv_offload_backend='cpu' (its default) has a CPU "
            "tier, which needs at least 1 byte (for none, set kv_offload_backend to 'disk')",
        ),
        (
            {"kv_offload_backend": "cpu+disk", "disk_path": "/t", "cpu_bytes_to_use_per_rank": 0},
            "cpu_bytes_to_use_per_rank=0 is invalid: kv_offload_backend='cpu+disk' has a CPU",
        ),
        ({"kv_offload_backend": "disk", "disk_path": ""}, "disk_path='' is invalid: it is empty"),
        ({"kv_offload_backend": "disk", "disk_path": None}, "needs disk_path"),
        ({**DISK, "disk_path": None}, "disk_bytes=1073741824 needs disk_path"),
        ({**DISK, "disk_path": ""}, "disk_path='' is invalid: it is empty"),
        ({"cpu_bytes": 0, "disk_path": ""}, "no lower tier"),
    ],
)
def test_an_empty_value_for_a_tier_in_use_is_refused_naming_it(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        convert(extra)


@pytest.mark.parametrize(
    ("key", "value", "field", "expected"),
    [
        ("disk_buffer_slots", "4", "disk_buffer_slots", 4),
        ("disk_buffer_slots", " 4 ", "disk_buffer_slots", 4),
        ("disk_buffer_slots", "+4", "disk_buffer_slots", 4),
        ("disk_buffer_slots", 4.0, "disk_buffer_slots", 4),
        ("num_blocks", "10", "num_blocks", 10),
        ("cpu_bytes", "1073741824", "cpu_bytes", GIB),
        ("cpu_bytes", 1073741824.0, "cpu_bytes", GIB),
        ("disk_bytes", "2147483648", "disk_bytes", 2 * GIB),
    ],
)
def test_an_int_key_takes_a_string_of_digits_or_a_whole_float(
    key: str, value: object, field: str, expected: int
) -> None:
    """Regression: `"disk_buffer_slots": "4"` was refused ("must be an int, got '4'"),
    where vLLM's connectors read the same key with int()."""
    assert getattr(convert({**DISK, key: value}), field) == expected


def test_num_cpu_blocks_takes_a_string_of_digits_too() -> None:
    """One rule for every int key (vLLM's connector is stricter here: kvtier is the one
    that would otherwise refuse a config the other keys of which it takes)."""
    config = convert({"cpu_bytes_to_use": GIB, "num_cpu_blocks": "10"})
    assert config.num_blocks == 10


@pytest.mark.parametrize("extra", [{"cpu_bytes_to_use": GIB}, {"cpu_bytes": GIB}])
def test_a_null_num_cpu_blocks_is_unset_as_vllm_reads_it(extra: dict[str, object]) -> None:
    """Regression: "num_cpu_blocks must be an int, got None", where vLLM's connector and
    kvtier's own num_blocks take null as unset (and with kvtier's keys it was "mixed")."""
    assert convert({**extra, "num_cpu_blocks": None}).num_blocks is None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("disk_buffer_slots", True, "disk_buffer_slots must be an int, got True"),
        ("disk_buffer_slots", "true", "disk_buffer_slots must be an int, got 'true'"),
        ("disk_buffer_slots", 4.5, "disk_buffer_slots must be a whole number, got 4.5"),
        ("disk_buffer_slots", "4.5", "disk_buffer_slots must be an int, got '4.5'"),
        ("disk_buffer_slots", "-4", "disk_buffer_slots=-4 is invalid: must be >= 1"),
        ("disk_buffer_slots", "0", "disk_buffer_slots=0 is invalid: must be >= 1"),
        ("disk_buffer_slots", "65", "disk_buffer_slots=65 is invalid: must be <= 64"),
        ("disk_buffer_slots", "four", "disk_buffer_slots must be an int, got 'four'"),
        ("disk_buffer_slots", "", "disk_buffer_slots must be an int, got ''"),
        ("disk_buffer_slots", "1_0", "disk_buffer_slots must be an int, got '1_0'"),
        ("disk_buffer_slots", "\u0664", "disk_buffer_slots must be an int, got '\u0664'"),
        ("disk_buffer_slots", "4 4", "disk_buffer_slots must be an int, got '4 4'"),
        ("num_blocks", "1", "num_blocks=1 is invalid: must be >= 2"),
        ("cpu_bytes", "1GiB", "cpu_bytes must be an int, got '1GiB'"),
        ("cpu_bytes", "1e9", "cpu_bytes must be an int, got '1e9'"),
        ("cpu_bytes", "-1", "cpu_bytes=-1 is invalid: must be >= 0"),
        ("cpu_bytes", float("inf"), "cpu_bytes must be a whole number, got inf"),
        ("disk_bytes", "9" * 5000, "disk_bytes must be an int, got '9999"),
    ],
)
def test_an_int_key_still_refuses_what_is_not_a_whole_number(
    key: str, value: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        convert({**DISK, key: value})


@pytest.mark.parametrize(("key", "extra"), [("disk_bytes", DISK), ("cpu_bytes_to_use", {})])
def test_a_number_too_long_to_read_is_refused_with_its_start_only(
    key: str, extra: dict[str, object]
) -> None:
    """More digits than int() reads: the message quotes the first 40, not all 5000."""
    with pytest.raises(ConfigError, match=re.escape(f"{key} must be an int, got '9999")) as error:
        convert({**extra, key: "9" * 5000})
    assert len(str(error.value)) < 100


def test_mixed_spellings_name_the_simple_offload_keys_too() -> None:
    """Regression: "cpu_bytes mixed with SimpleCPUOffloadConnector keys" did not say
    which (`use_page_cache` does not look like one)."""
    with pytest.raises(ConfigError, match=re.escape("keys (use_page_cache): use one spelling")):
        convert({"cpu_bytes": GIB, "use_page_cache": True})
