"""`OffloadConfig.prepare_host` at its edges (`offload/host.py`): a budget equal to what
the machine has passes and one byte more is refused, an unknown machine size refuses
nothing, a directory created for a disk tier too large for its file system is removed
again, a probe file another user owns is left alone, and a disk path without a disk tier
is not touched."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_config_host import a_dead_pid, age, disk_config

import kvtier.offload.host as offload_host
from kvtier.offload.config import ConfigError, OffloadConfig

MIB = 1 << 20


def test_a_cpu_budget_of_exactly_the_memory_passes_and_one_byte_more_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(offload_host, "total_memory_bytes", lambda: 64 * MIB)
    OffloadConfig(cpu_bytes=64 * MIB).prepare_host()
    with pytest.raises(ConfigError, match="exceeds this machine's memory"):
        OffloadConfig(cpu_bytes=64 * MIB + 1).prepare_host()


def test_a_disk_budget_of_exactly_the_file_system_passes_and_one_byte_more_is_refused(
    tmp_path: Path,
) -> None:
    size = shutil.disk_usage(tmp_path).total
    disk_config(tmp_path, disk_bytes=size).prepare_host()
    with pytest.raises(ConfigError, match="exceeds the size of the filesystem"):
        disk_config(tmp_path, disk_bytes=size + 1).prepare_host()


def test_a_machine_whose_size_is_unknown_refuses_no_cpu_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sysconf says nothing and no cgroup file exists: no limit is known (a mutant
    counted the unknown size as 0 bytes and refused every budget)."""

    def no_sysconf(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    monkeypatch.setattr(offload_host, "CGROUP_MEMORY_LIMITS", (tmp_path / "missing",))
    assert offload_host.total_memory_bytes() is None
    OffloadConfig(cpu_bytes=MIB).prepare_host()


def test_a_directory_created_for_a_disk_tier_too_large_is_removed(tmp_path: Path) -> None:
    """The refusal leaves the file system as it found it (a mutant left the new,
    empty directory behind)."""
    missing = tmp_path / "tier"
    too_large = shutil.disk_usage(tmp_path).total + 1
    with pytest.raises(ConfigError, match="exceeds the size of the filesystem"):
        disk_config(missing, disk_bytes=too_large).prepare_host()
    assert not missing.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_dead_processs_probe_another_user_owns_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only this user's probes are removed: another user's, even old and with no live
    pid, is theirs to deal with (a mutant removed it)."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    theirs = tmp_path / f".kvtier-probe-{a_dead_pid()}-x1y2z3"
    theirs.write_bytes(b"")
    os.chown(theirs, 4242, 4242)
    age(theirs)
    disk_config(tmp_path).prepare_host()
    assert list(tmp_path.iterdir()) == [theirs]


def test_a_disk_path_without_a_disk_tier_is_not_touched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """disk_bytes 0: disk_path is ignored (with a warning), and no directory is made for
    it (a mutant checked and created it all the same)."""
    config = OffloadConfig(cpu_bytes=MIB, disk_path=str(tmp_path / "tier"))
    assert "ignoring disk_path" in caplog.text
    config.prepare_host()
    assert not (tmp_path / "tier").exists()
