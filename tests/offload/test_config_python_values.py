"""`OffloadConfig` built in Python takes the values Python code holds: a `pathlib.Path`
as `disk_path` and numpy ints as sizes, as `EngineConfig` and `SamplingParams` do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.offload.config import ConfigError, OffloadConfig


def test_a_path_object_is_a_disk_path(tmp_path: Path) -> None:
    """Regression: `disk_path=tmp_path` was refused ("disk_path must be a str, got
    PosixPath(...)"), though every path API of Python takes one."""
    config = OffloadConfig(disk_bytes=1 << 20, disk_path=tmp_path / "tier")  # type: ignore[arg-type]
    assert config.disk_path == str(tmp_path / "tier")
    assert type(config.disk_path) is str
    assert config == OffloadConfig(disk_bytes=1 << 20, disk_path=str(tmp_path / "tier"))
    from_dict = OffloadConfig.from_dict({"disk_bytes": 1 << 20, "disk_path": tmp_path})
    assert from_dict.disk_path == str(tmp_path)


def test_numpy_ints_are_sizes() -> None:
    """Regression: `cpu_bytes=np.int64(...)` (a size computed with numpy) was refused,
    where `EngineConfig(num_gpu_blocks=np.int64(...))` is taken."""
    config = OffloadConfig(cpu_bytes=np.int64(1 << 20), num_blocks=np.int32(8))  # type: ignore[arg-type]
    assert config == OffloadConfig(cpu_bytes=1 << 20, num_blocks=8)
    assert type(config.cpu_bytes) is int
    assert type(config.num_blocks) is int


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"cpu_bytes": True}, "cpu_bytes must be an int, got True"),
        ({"cpu_bytes": np.bool_(True)}, "cpu_bytes must be an int, got "),
        ({"cpu_bytes": np.float64(1 << 20)}, "cpu_bytes must be an int, got "),
        ({"cpu_bytes": np.int64(-1)}, "cpu_bytes=-1 is invalid: must be >= 0"),
        ({"disk_bytes": 1 << 20, "disk_path": b"/tmp"}, "disk_path must be a str, got b'/tmp'"),
    ],
)
def test_other_values_are_still_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadConfig(**values)  # type: ignore[arg-type]
