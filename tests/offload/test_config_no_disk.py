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


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_disk_path_without_a_disk_tier_is_none_however_the_config_is_built(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Was: OffloadConfig(...) refused it ("disk_path='' is invalid: it is empty") while
    # from_dict and the vLLM connector took it as no path (a templated config's value).
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert OffloadConfig(cpu_bytes=MIB, disk_path=path).disk_path is None
        assert OffloadConfig.from_dict({"cpu_bytes": MIB, "disk_path": path}).disk_path is None
    assert messages(caplog) == []
    with pytest.raises(ConfigError, match=r"disk_path=.* is invalid: it is empty"):
        OffloadConfig(cpu_bytes=MIB, disk_bytes=MIB, disk_path=path)


@pytest.mark.parametrize("key", ["cpu_bytes", "disk_bytes"])
def test_a_bad_size_is_refused_before_anything_is_ignored_for_it(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Was: "no disk tier (disk_bytes=''): ignoring disk_path='/tmp'" (or "cascade needs
    # both cpu_bytes and disk_bytes: ignoring it"), then "disk_bytes must be an int".
    values = {"cpu_bytes": MIB, "disk_bytes": MIB, "disk_path": "/tmp", "cascade": "write_back"}
    with (
        caplog.at_level(logging.WARNING, logger="kvtier"),
        pytest.raises(ConfigError, match=f"{key} must be an int, got ''"),
    ):
        OffloadConfig.from_dict({**values, key: ""})
    assert messages(caplog) == []
