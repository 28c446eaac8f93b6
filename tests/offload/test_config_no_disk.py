"""Disk keys without a disk tier (`disk_bytes` 0 or unset): ignored with a warning that
names them and why there is no disk tier (SPEC §8), whichever way the config is built.

Decision (review): not an error. SPEC §8 says these keys are ignored with a warning, and
`disk_bytes=0` is how a deployment switches its disk tier off while keeping the rest of
its settings; the warning names both keys. An invalid value in them is still an error.

Regression: `OffloadConfig(disk_bytes=0, disk_path=...)` built directly (the engine's
`LLM(kv_offload=...)`) ignored `disk_path` silently; `from_dict` warned.
"""

from __future__ import annotations

import logging

import pytest

from kvtier.offload.config import ConfigError, OffloadConfig

MIB = 1 << 20


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_disk_path_given_directly_without_a_disk_tier_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        config = OffloadConfig(cpu_bytes=MIB, disk_bytes=0, disk_path="/tmp/kv")
    assert config.disk_bytes == 0
    assert messages(caplog) == ["no disk tier (disk_bytes=0): ignoring disk_path='/tmp/kv'"]


def test_from_dict_names_every_disk_key_it_ignores_and_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    values = {
        "cpu_bytes": MIB,
        "disk_bytes": 0,
        "disk_path": "/tmp/kv",
        "disk_io_mode": "PAGE_CACHE",
    }
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        config = OffloadConfig.from_dict(values)
    assert config.disk_path is None  # ignored: the config equals one without them
    assert config == OffloadConfig(cpu_bytes=MIB)
    assert messages(caplog) == [
        "no disk tier (disk_bytes=0): ignoring disk_io_mode='page_cache', disk_path='/tmp/kv'"
    ]


def test_an_invalid_value_in_an_ignored_disk_key_is_still_an_error() -> None:
    with pytest.raises(ConfigError, match="disk_buffer_slots"):
        OffloadConfig.from_dict({"cpu_bytes": MIB, "disk_bytes": 0, "disk_buffer_slots": 0})


def test_no_tier_at_all_is_an_error_naming_both_budgets() -> None:
    with pytest.raises(ConfigError, match="set cpu_bytes or disk_bytes"):
        OffloadConfig.from_dict({"disk_bytes": 0, "disk_path": "/tmp/kv"})
