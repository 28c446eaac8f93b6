"""`kvtier demo` with a disk tier larger than the free space: one line, never a traceback."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_demo_cli_errors import run_demo

from kvtier.cli import demo
from kvtier.cli.demo_checks import _check_free_space
from kvtier.engine.llm import LLM
from kvtier.offload.config import OffloadConfig

MIB = 1 << 20


class FullDiskLLM(LLM):
    """An engine whose disk tier cannot be made: the disk filled up after the checks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        offload = kwargs.get("kv_offload")
        if offload is not None and offload.disk_bytes > 0:
            raise OSError(errno.ENOSPC, "cannot size the disk tier file", "x.slots")
        super().__init__(*args, **kwargs)


def test_a_disk_tier_beyond_the_free_space_is_named_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: only the filesystem's size was checked; sizing the tier file failed
    # with an ENOSPC traceback when the disk run started, after the earlier runs.
    real = shutil.disk_usage(tmp_path)
    small = real._replace(total=8 * MIB, free=MIB + MIB // 2)  # less than --disk-mib=2
    checked: list[Path] = []

    def disk_usage(path: str | Path) -> Any:
        checked.append(Path(path))
        return small

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    assert run_demo(tmp_path, "--disk-io=page_cache", "--disk-mib=2") == 2
    # Regression: the message named the demo's temporary folder (gone when it is read)
    # and the disk_bytes key, not the folder checked, its space, or what to change.
    captured = capsys.readouterr()
    assert captured.err == (
        "kvtier demo: error: --disk-mib=2 is too large for the disk tier run: the filesystem"
        f" holding {tmp_path} has 1 MiB free (8 MiB in all); point --disk-dir at a folder on"
        " a larger filesystem, or use a smaller --disk-mib\n"
    )
    assert checked == [tmp_path]  # --disk-dir, where the demo made its folder
    assert "serving" not in captured.out
    assert list(tmp_path.glob("kvtier-demo-*")) == []


def test_a_tier_that_cannot_be_made_when_its_run_starts_ends_the_demo_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: the disk filling up after the checks gave an OSError traceback.
    monkeypatch.setattr(demo, "LLM", FullDiskLLM)
    assert run_demo(tmp_path, "--disk-io=page_cache") == 1
    captured = capsys.readouterr()
    assert captured.err == (
        "kvtier demo: error: the disk tier run cannot start: [Errno 28] cannot size the disk"
        " tier file: 'x.slots'\n"
    )
    assert list(tmp_path.glob("kvtier-demo-*")) == []


def test_a_disk_tier_of_exactly_the_free_space_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a mutation run (s29): refusing a tier of exactly the free space (`>=` for
    `>`) passed every test; the file fits."""
    usage = shutil.disk_usage(tmp_path)._replace(total=8 * MIB, free=2 * MIB)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    disk = str(tmp_path / "kvtier-demo-x")
    _check_free_space(OffloadConfig(disk_bytes=2 * MIB, disk_path=disk), "too large")
    with pytest.raises(ValueError, match=r"^too large: the filesystem holding .* has 2 MiB free"):
        _check_free_space(OffloadConfig(disk_bytes=2 * MIB + 4096, disk_path=disk), "too large")
