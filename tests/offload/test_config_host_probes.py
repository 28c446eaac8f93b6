"""`OffloadConfig.prepare_host` beyond its plain checks (`offload/host.py`): which
container limit counts, what it returns and may remove, how a directory it cannot
create is named, and which leftover probe files it removes."""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from test_config_host import a_dead_pid, age, disk_config

import kvtier.offload.host as offload_host
from kvtier.offload.config import ConfigError, OffloadConfig

MIB = 1 << 20


def test_a_cgroup_v1_memory_limit_counts_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cgroup v2 file: the v1 limit is the memory (a mutant read only v2's)."""
    v1 = tmp_path / "memory.limit_in_bytes"
    v1.write_text("8388608\n")
    monkeypatch.setattr(offload_host, "CGROUP_MEMORY_LIMITS", (tmp_path / "missing", v1))
    with pytest.raises(ConfigError, match="container's limit \\(8388608 bytes\\)"):
        OffloadConfig(cpu_bytes=16 * MIB).prepare_host()


def test_an_unreadable_cgroup_file_says_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cgroup path that cannot be read as a file (here a directory) is no limit, not
    an error (a mutant let IsADirectoryError out of prepare_host)."""
    folder = tmp_path / "memory.max"
    folder.mkdir()
    monkeypatch.setattr(offload_host, "CGROUP_MEMORY_LIMITS", (folder,))
    assert offload_host.total_memory_bytes() is not None  # the machine's
    OffloadConfig(cpu_bytes=MIB).prepare_host()


def test_prepare_host_returns_the_directory_it_created_and_only_that(tmp_path: Path) -> None:
    """The caller removes what it created if its start fails (a mutant returned None:
    an engine that failed to start left the new directory behind)."""
    assert disk_config(tmp_path / "tier").prepare_host() == tmp_path / "tier"
    assert disk_config(tmp_path / "tier").prepare_host() is None  # there already


def test_removing_a_created_directory_that_is_no_longer_empty_never_raises(
    tmp_path: Path,
) -> None:
    """A directory the tier wrote into stays, quietly (a mutant raised OSError from the
    clean-up of a failed start, hiding the start's own error)."""
    created = disk_config(tmp_path / "tier").prepare_host()
    assert created is not None
    (created / "rank0.slots").write_bytes(b"")
    offload_host.remove_created_directory(created)
    assert (created / "rank0.slots").exists()
    offload_host.remove_created_directory(tmp_path / "gone")  # already removed: quiet too


def test_a_directory_another_process_creates_meanwhile_is_used_not_claimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process creates `disk_path` between the check and the mkdir: it is used,
    and not returned as created (a mutant refused it as not creatable)."""
    real_mkdir = Path.mkdir

    def racing_mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        real_mkdir(self)
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(self))

    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    assert disk_config(tmp_path / "tier").prepare_host() is None
    assert (tmp_path / "tier").is_dir()


def test_a_directory_that_cannot_be_created_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mkdir fails (here: permission denied, as a non-root user under a root-owned
    parent): a ConfigError naming the key, not a bare OSError (a mutant caught only
    FileNotFoundError)."""

    def refused_mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "mkdir", refused_mkdir)
    tier = tmp_path / "tier"
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"disk_path={str(tier)!r}: cannot create the directory (Permission denied)"
        ),
    ):
        disk_config(tier).prepare_host()


def test_the_probe_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """Each check closes its probe (a mutant leaked one descriptor per start)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd here")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        disk_config(tmp_path).prepare_host()
    assert len(os.listdir("/proc/self/fd")) == before


def test_where_unnamed_files_work_no_named_probe_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unnamed probe (O_TMPFILE) first: it leaves nothing behind when the check is
    killed (a mutant always made a named one)."""
    if getattr(os, "O_TMPFILE", None) is None:
        pytest.skip("no O_TMPFILE here")
    try:
        os.close(os.open(tmp_path, os.O_TMPFILE | os.O_WRONLY, 0o600))
    except OSError:
        pytest.skip("this file system has no unnamed files")
    named: list[str] = []
    real_mkstemp = tempfile.mkstemp

    def recording_mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real_mkstemp(*args, **kwargs)
        named.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", recording_mkstemp)
    disk_config(tmp_path).prepare_host()
    assert named == []


def test_an_unnamed_probe_failing_for_another_reason_refuses_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only "no unnamed files here" falls back to a named probe; another error (here
    EIO) is the directory's (a mutant fell back on any error, and passed)."""
    real_open = os.open

    def failing_tmpfile(path: str, flags: int, *args: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return real_open(path, flags, *args)

    if getattr(os, "O_TMPFILE", None) is None:
        pytest.skip("no O_TMPFILE here")
    monkeypatch.setattr(os, "open", failing_tmpfile)
    with pytest.raises(ConfigError, match="cannot create files in it: Input/output error"):
        disk_config(tmp_path).prepare_host()


def leave_a_named_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run a check whose named probe could not be removed; return the probe left."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    real_unlink = os.unlink

    def failing_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))

    monkeypatch.setattr(os, "unlink", failing_unlink)
    disk_config(tmp_path).prepare_host()
    monkeypatch.setattr(os, "unlink", real_unlink)
    (left,) = tmp_path.iterdir()
    return left


def test_a_probe_this_process_could_not_remove_is_named_by_its_pid_and_removed_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's name carries this pid and a dash (a mutant ran the random part into
    the pid: no check could tell whose it was); once old, the next check of this
    process removes it as a dead check's (a mutant still counted it as this process's
    own probe in flight and kept it for good)."""
    left = leave_a_named_probe(tmp_path, monkeypatch)
    assert left.name.startswith(f".kvtier-probe-{os.getpid()}-")
    disk_config(tmp_path).prepare_host()
    assert left.exists()  # fresh: kept
    age(left)
    disk_config(tmp_path).prepare_host()
    assert not left.exists()


def test_only_regular_files_named_as_probes_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old symlink and a FIFO named as a dead process's probe, and an old hidden
    file that is no probe, stay (mutants removed the link: they followed it or did not
    look at the file's type; another took every `.kvtier` name for a probe)."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    pid = a_dead_pid()
    target = tmp_path / "target"
    target.write_bytes(b"")
    link = tmp_path / f".kvtier-probe-{pid}-link00"
    link.symlink_to(target)
    fifo = tmp_path / f".kvtier-probe-{pid}-fifo00"
    os.mkfifo(fifo)
    other = tmp_path / ".kvtier-notes"
    other.write_bytes(b"")
    age(target, other, fifo)
    os.utime(link, (0, 0), follow_symlinks=False)
    disk_config(tmp_path).prepare_host()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [target.name, link.name, fifo.name, other.name]
    )


def test_a_probe_whose_pid_is_another_users_live_process_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.kill says EPERM: the pid is alive, another user's (a mutant took it for dead
    and removed the probe of a running check)."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    probe = tmp_path / f".kvtier-probe-{a_dead_pid()}-x1y2z3"
    probe.write_bytes(b"")
    age(probe)

    def not_permitted(pid: int, signal: int) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "kill", not_permitted)
    disk_config(tmp_path).prepare_host()
    assert probe.exists()
