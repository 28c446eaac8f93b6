"""`OffloadConfig.prepare_host`: the tiers' budgets and disk path against this machine.

Regressions: a `disk_path` that was a file or missing failed with a raw OS error in the
storage layer; a disk budget of 10**14 bytes raised MemoryError building the tier index,
a CPU budget of 10**13 bytes got the process killed for lack of memory.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import kvtier.offload.host as offload_host
from kvtier.offload.config import ConfigError, OffloadConfig

MIB = 1 << 20


def disk_config(path: Path | str, disk_bytes: int = MIB) -> OffloadConfig:
    """Return a disk-only config over `path`."""
    return OffloadConfig(disk_bytes=disk_bytes, disk_path=str(path))


def test_a_file_is_not_a_disk_path(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=f"disk_path='{afile}' is not a directory"):
        disk_config(afile).prepare_host()


def test_a_missing_directory_is_created_when_its_parent_exists(tmp_path: Path) -> None:
    config = disk_config(tmp_path / "tier")
    assert not (tmp_path / "tier").exists(), "building the config touches no filesystem"
    config.prepare_host()
    assert (tmp_path / "tier").is_dir()
    assert stat.S_IMODE((tmp_path / "tier").stat().st_mode) & 0o077 == 0  # private, as its files
    config.prepare_host()  # already there: fine


def test_a_missing_parent_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tier"
    with pytest.raises(
        ConfigError,
        match=r"disk_path=.*nope/tier' does not exist and cannot be created: its parent "
        r".*/nope' does not exist either",
    ):
        disk_config(missing).prepare_host()
    assert not (tmp_path / "nope").exists()


def test_a_parent_that_is_a_file_is_named_as_not_a_directory(tmp_path: Path) -> None:
    """Regression: a path under a regular file was reported as a missing parent directory."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    message = f"its parent '{afile}' is not a directory"
    with pytest.raises(ConfigError, match=message):
        disk_config(afile / "tier").prepare_host()


def test_a_disk_path_longer_than_the_system_takes_is_named_at_start_up(tmp_path: Path) -> None:
    """Regression (s34): a 300-byte folder name (ENAMETOOLONG) raised a bare OSError from
    `Path.exists`, naming no key; so did a path past PATH_MAX made of short names."""
    long_name = tmp_path / ("t" * 300)
    with pytest.raises(
        ConfigError, match=r"^disk_path='.*': the name tttttttttttttttt\.\.\. is 300"
    ):
        disk_config(long_name).prepare_host()
    long_path = str(tmp_path) + "/t" * 2100
    with pytest.raises(
        ConfigError, match=r"^disk_path='.*': the path is \d+ bytes long, more than"
    ):
        disk_config(long_path).prepare_host()
    assert list(tmp_path.iterdir()) == []


def test_home_and_relative_paths_are_made_absolute_when_the_config_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: "~/kvtier" failed as missing; a relative path followed later chdirs."""
    monkeypatch.setenv("HOME", str(tmp_path))
    home = OffloadConfig.from_dict({"disk_bytes": MIB, "disk_path": "~/kvtier"})
    assert home.disk_path == str(tmp_path / "kvtier")
    home.prepare_host()
    assert (tmp_path / "kvtier").is_dir()
    monkeypatch.chdir(tmp_path)
    relative = disk_config("tiers/../rel")
    monkeypatch.chdir("/")
    assert relative.disk_path == str(tmp_path / "rel")
    relative.prepare_host()
    assert (tmp_path / "rel").is_dir()


def test_a_dangling_symlink_is_not_a_directory(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match="link' is not a directory"):
        disk_config(link).prepare_host()


def test_budgets_beyond_the_machine_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"cpu_bytes={1 << 60} exceeds this machine's memory"):
        OffloadConfig(cpu_bytes=1 << 60).prepare_host()
    with pytest.raises(
        ConfigError,
        match=f"disk_bytes={1 << 62} exceeds the size of the filesystem holding disk_path=",
    ):
        disk_config(tmp_path, disk_bytes=1 << 62).prepare_host()


@pytest.mark.parametrize(("limit", "refused"), [("max\n", False), ("8388608\n", True)])
def test_a_container_memory_limit_is_the_memory(
    limit: str, refused: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "missing"
    v2.write_text(limit)
    monkeypatch.setattr(offload_host, "CGROUP_MEMORY_LIMITS", (v2, v1))
    budget = OffloadConfig(cpu_bytes=16 * MIB)  # more than 8 MiB, less than any machine
    if refused:
        with pytest.raises(ConfigError, match="container's limit \\(8388608 bytes\\)"):
            budget.prepare_host()
    else:
        budget.prepare_host()  # "max": no limit


def test_sensible_budgets_pass(tmp_path: Path) -> None:
    OffloadConfig(cpu_bytes=4 * MIB).prepare_host()
    disk_config(tmp_path).prepare_host()
    OffloadConfig(cpu_bytes=MIB, disk_bytes=2 * MIB, disk_path=str(tmp_path)).prepare_host()


def refuse_writes_under(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make `folder` (existing or not) read-only as a read-only mount is, also for root:
    every open for writing in it or below it fails with EROFS, and `os.access` says it
    cannot be written (access(2) fails with EROFS there)."""
    real_open, real_access = os.open, os.access

    def read_only_open(path: str | os.PathLike[str], flags: int, *args: Any) -> int:
        inside = (os.path.abspath(path) + "/").startswith(f"{folder}/")
        if inside and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_open(path, flags, *args)

    def read_only_access(path: str | os.PathLike[str], mode: int, **kwargs: Any) -> bool:
        inside = (os.path.abspath(path) + "/").startswith(f"{folder}/")
        return not (inside and mode & os.W_OK) and real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    monkeypatch.setattr(os, "access", read_only_access)


@pytest.mark.parametrize("exists", [True, False])
def test_a_directory_no_file_can_be_created_in_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exists: bool
) -> None:
    """Regression: only the permission bits were checked (`os.access`), which pass for
    root on a directory it cannot write (e.g. a root-squashed NFS export): the tier failed
    only later, as its file was created (in `LLM`, after the model was built). And where
    `os.access` did refuse (a read-only mount), the reason was given as "permission
    denied": the probe's error names it."""
    disk_dir = tmp_path / "tier"
    if exists:
        disk_dir.mkdir()
    refuse_writes_under(monkeypatch, disk_dir)
    with pytest.raises(ConfigError) as refused:
        disk_config(disk_dir).prepare_host()
    assert str(refused.value) == (
        f"disk_path={str(disk_dir)!r} is not a writable directory (cannot create files in it: "
        "Read-only file system)"
    )
    assert disk_dir.exists() == exists  # one it created for the check is removed again
    if exists:
        assert list(disk_dir.iterdir()) == []  # no probe left behind


def test_a_file_system_without_unnamed_files_is_probed_with_a_named_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_tmpfile(path: str, flags: int, *args: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_tmpfile)
    disk_config(tmp_path).prepare_host()
    assert list(tmp_path.iterdir()) == []
    refuse_writes_under(monkeypatch, tmp_path)  # wraps no_tmpfile
    with pytest.raises(ConfigError, match="cannot create files in it: Read-only file system"):
        disk_config(tmp_path).prepare_host()


def test_an_os_without_unnamed_files_is_probed_with_a_named_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: os.O_TMPFILE is Linux's; elsewhere (macOS) the probe raised
    AttributeError out of `prepare_host` for every disk tier."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    disk_config(tmp_path).prepare_host()
    assert list(tmp_path.iterdir()) == []
    refuse_writes_under(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match="cannot create files in it: Read-only file system"):
        disk_config(tmp_path).prepare_host()


def a_dead_pid() -> int:
    """Return the pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("name", ["dead", "same_pid", "no_pid"])
def test_a_probe_left_by_a_dead_process_is_removed_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Regression: where a named probe is needed (no O_TMPFILE), a process killed between
    creating and removing it left `.kvtier-probe-...` in `disk_path` for good. The next
    start removes one whose process is gone: another pid, or this process's own pid
    reused (an engine in a container gets the same pid every start), or an older name
    without a pid. A live process's probe and other files are left alone."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    pid = {"dead": a_dead_pid(), "same_pid": os.getpid(), "no_pid": None}[name]
    left = tmp_path / (".kvtier-probe-" + (f"{pid}-" if pid is not None else "") + "x1y2z3")
    left.write_bytes(b"")
    live = tmp_path / f".kvtier-probe-{os.getppid()}-a1b2c3"  # the parent is running
    live.write_bytes(b"")
    other = tmp_path / "rank0.slots"
    other.write_bytes(b"")
    age(left, live, other)  # left at an earlier start
    disk_config(tmp_path).prepare_host()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def age(*paths: Path) -> None:
    """Date `paths` back a day: past the age under which a probe is never removed."""
    then = time.time() - 86400
    for path in paths:
        os.utime(path, (then, then))


@pytest.mark.parametrize("pid_text", ["99999999999999", "\u00b2", "0"])
def test_a_probe_name_with_no_pid_of_a_process_never_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pid_text: str
) -> None:
    """Regression: `.kvtier-probe-99999999999999-x` made prepare_host raise OverflowError
    (os.kill of more than any pid), `.kvtier-probe-\u00b2-x` ValueError (a digit int()
    refuses), and `.kvtier-probe-0-x` was kept for good (os.kill(0, 0) signals the
    process group: "alive"). Any user who can create files in a shared disk_path could
    stop every engine's start. Such a probe is no process's: it is removed."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    odd = tmp_path / f".kvtier-probe-{pid_text}-x1y2z3"
    odd.write_bytes(b"")
    age(odd)
    disk_config(tmp_path).prepare_host()
    assert list(tmp_path.iterdir()) == []


def test_a_fresh_probe_is_kept_though_no_process_here_has_its_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a live check's probe was removed when its pid was not visible here (a
    container in another pid namespace sharing the directory, another machine): only
    one old enough to be a dead check's is."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    fresh = tmp_path / f".kvtier-probe-{a_dead_pid()}-x1y2z3"  # another namespace's pid
    fresh.write_bytes(b"")
    disk_config(tmp_path).prepare_host()
    assert list(tmp_path.iterdir()) == [fresh]
