"""Checks that this machine can hold the configured tiers (`OffloadConfig.prepare_host`):
host memory for the CPU tier, a writable directory and a large enough filesystem for the
disk tier."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from kvtier.offload.config_error import ConfigError
from kvtier.offload.path_limits import path_length_problem

logger = logging.getLogger(__name__)


def check_host(cpu_bytes: int, disk_bytes: int, disk_path: str | None) -> Path | None:
    """Raise ConfigError naming the key and value when the tiers cannot fit this machine;
    create a missing `disk_path` directory and return it (None when none was created),
    removing it again when a check fails (see `OffloadConfig.prepare_host`)."""
    if cpu_bytes > 0:
        memory = total_memory_bytes()
        if memory is not None and cpu_bytes > memory:
            raise ConfigError(
                f"cpu_bytes={cpu_bytes} exceeds this machine's memory, or its "
                f"container's limit ({memory} bytes)"
            )
    if not (disk_bytes > 0 and disk_path):
        return None
    created = _prepare_directory(disk_path)
    size = shutil.disk_usage(disk_path).total
    if disk_bytes > size:
        remove_created_directory(created)
        raise ConfigError(
            f"disk_bytes={disk_bytes} exceeds the size of the filesystem holding "
            f"disk_path={disk_path!r} ({size} bytes)"
        )
    return created


def remove_created_directory(directory: Path | None) -> None:
    """Remove a directory `check_host` created (`directory`, None: none) if it is still
    empty, for a start that failed after it; never raises."""
    if directory is not None:
        with contextlib.suppress(OSError):
            directory.rmdir()


# A container's memory limit: cgroup v2, then v1 (which reports "no limit" as a huge number).
CGROUP_MEMORY_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def total_memory_bytes() -> int | None:
    """Return the memory this process may use: the machine's, or its container's limit.

    None where the OS does not say. A budget above a container's limit would not fail
    here but get the process killed once the tier is filled.
    """
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = 0
    limits = [limit for limit in map(_cgroup_limit, CGROUP_MEMORY_LIMITS) if limit]
    candidates = [total, *limits] if total > 0 else limits
    return min(candidates) if candidates else None


def _cgroup_limit(path: Path) -> int | None:
    """Return the byte limit in a cgroup file, or None: no file, "max", or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _prepare_directory(disk_path: str) -> Path | None:
    """Check `disk_path` is a writable directory; create it if missing and return it then."""
    too_long = path_length_problem(disk_path)
    if too_long is not None:  # `Path.exists` would raise OSError (ENAMETOOLONG)
        raise ConfigError(f"disk_path={disk_path!r}: {too_long}")
    path = Path(disk_path)
    created = None
    if not path.exists() and not path.is_symlink():
        parent = path.parent
        if not parent.is_dir():
            problem = "is not a directory" if parent.exists() else "does not exist either"
            raise ConfigError(
                f"disk_path={disk_path!r} does not exist and cannot be created: its parent "
                f"{str(parent)!r} {problem}"
            )
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass  # created meanwhile by another process
        except OSError as exc:
            raise ConfigError(
                f"disk_path={disk_path!r}: cannot create the directory ({exc.strerror})"
            ) from exc
        else:
            logger.info("created the disk tier directory %s", disk_path)
            created = path
    if not path.is_dir():
        raise ConfigError(f"disk_path={disk_path!r} is not a directory")
    unwritable = _cannot_create_files(path)  # not os.access: it names no reason (EROFS)
    if unwritable is not None:
        remove_created_directory(created)
        raise ConfigError(f"disk_path={disk_path!r} is not a writable directory ({unwritable})")
    return created


def _cannot_create_files(directory: Path) -> str | None:
    """Return why no file can be created in `directory`, or None when one can.

    Found by creating one, as the tier will later (in `LLM`, after the model is built):
    permission bits do not tell for root, nor for a read-only mount seen through NFS's
    root squashing, a FUSE file system or a security module. The probe is an unnamed
    file (O_TMPFILE) where the OS and file system have them, so an interrupted check leaves
    nothing behind; elsewhere a hidden file named `.kvtier-probe-<pid>-...`, removed at
    once. One a process left there when it died between creating and removing it is
    removed by the next check (`_remove_dead_probes`).
    """
    _remove_dead_probes(directory)
    try:
        os.close(_create_probe(directory))
    except OSError as exc:
        return f"cannot create files in it: {exc.strerror or type(exc).__name__}"
    return None


PROBE_PREFIX = ".kvtier-probe-"
# A probe younger than this is never removed as a dead process's: a check removes its own
# within milliseconds, and a live one's pid may not be visible here (another pid namespace:
# a container sharing the directory, or another machine).
PROBE_MIN_AGE_S = 300.0
_OWN_PROBES: set[str] = set()  # the names of this process's probes not yet removed


def _create_probe(directory: Path) -> int:
    """Create a file in `directory` that is gone once closed; return its descriptor."""
    unnamed = getattr(os, "O_TMPFILE", None)  # Linux only
    if unnamed is not None:
        try:
            return os.open(directory, unnamed | os.O_WRONLY, 0o600)
        except OSError as exc:  # the file system has none (or the kernel: EISDIR)
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    fd, probe = tempfile.mkstemp(dir=directory, prefix=f"{PROBE_PREFIX}{os.getpid()}-")
    _OWN_PROBES.add(os.path.basename(probe))
    try:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    finally:
        _OWN_PROBES.discard(os.path.basename(probe))
    return fd


def _remove_dead_probes(directory: Path) -> None:
    """Remove the named probe files in `directory` that no live process of this machine
    made (its pid is in the name; older names had none): regular files this user owns,
    at least `PROBE_MIN_AGE_S` old, left by a check that died before removing its probe;
    never raises, whatever the names in `directory`.

    The age keeps the probe of a live check whose pid is not visible here (a container
    in another pid namespace sharing the directory, another machine); were one removed
    all the same, that check's own removal of it is quiet.
    """
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return  # the probe that follows names the problem
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(PROBE_PREFIX):
            continue
        with contextlib.suppress(OSError):
            info = entry.stat(follow_symlinks=False)
            if (
                stat.S_ISREG(info.st_mode)
                and info.st_uid == os.geteuid()
                and now - info.st_mtime >= PROBE_MIN_AGE_S
                and not _probe_owner_alive(entry.name)
            ):
                os.unlink(entry.path)
                logger.info("removed a probe file left by a dead process: %s", entry.path)


def _probe_owner_alive(name: str) -> bool:
    """Return True when the probe file `name` was made by a process that is running."""
    pid_text = name[len(PROBE_PREFIX) :].partition("-")[0]
    if not (pid_text.isascii() and pid_text.isdigit()):  # int() refuses "²", a digit too
        return False
    pid = int(pid_text)
    if not 0 < pid <= 0x7FFFFFFF:  # no process's: os.kill would signal the process
        return False  # group (0), or raise OverflowError (more than any pid)
    if pid == os.getpid():  # this process's, or one of an earlier one given the same pid
        return name in _OWN_PROBES  # (an engine in a container often has the same pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True
