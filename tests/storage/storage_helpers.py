"""Helpers for disk tier tests: a directory where O_DIRECT works, faulty FileIOs, and
descriptor and garbage collection checks."""

from __future__ import annotations

import errno
import gc
import os
import time
import weakref
from dataclasses import dataclass

import pytest


def direct_io_dir(base: str) -> str:
    """Return `base` if O_DIRECT works there; skip the test otherwise."""
    probe = os.path.join(base, ".kvtier-odirect-probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        pytest.skip(f"O_DIRECT is not supported under {base}")
    os.close(fd)
    os.unlink(probe)
    return base


@dataclass(slots=True)
class ShortIO:
    """A FileIO that moves one byte less than asked, without touching the file."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return data.nbytes - 1

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        return into.nbytes - 1


@dataclass(slots=True)
class FlakyIO:
    """Real I/O unless a fault is armed: `write_errno` / `read_errno` raise that OSError."""

    write_errno: int | None = None
    read_errno: int | None = None

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if self.write_errno is not None:
            raise OSError(self.write_errno, os.strerror(self.write_errno))
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        if self.read_errno is not None:
            raise OSError(self.read_errno, os.strerror(self.read_errno))
        return os.preadv(fd, [into], offset)


def num_open_fds() -> int:
    """Return the number of descriptors this process holds open."""
    return len(os.listdir("/proc/self/fd"))


def collect(ref: weakref.ref[object], timeout_s: float = 10.0) -> None:
    """Collect garbage until `ref` is dead (an I/O thread may still hold its referent for
    a moment after the future it completed resolved); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while ref() is not None:
        assert time.monotonic() < deadline, "the object was never collected"
        gc.collect()
        time.sleep(0.01)
