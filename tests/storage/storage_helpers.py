"""Helpers for disk tier tests: a directory where O_DIRECT works, faulty and gated FileIOs,
descriptor and garbage collection checks, and threads parked at a known point."""

from __future__ import annotations

import errno
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

import pytest

WAIT_S = 30.0  # how long a test waits for another thread before it fails: never reached


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


@dataclass(slots=True)
class GatedIO:
    """Real I/O, but each write first sets `writing` and waits for `release` to be set."""

    writing: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self.writing.set()
        if not self.release.wait(WAIT_S):
            raise OSError(errno.ETIMEDOUT, "the test never released the write")
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        return os.preadv(fd, [into], offset)


def start_until_parked(target: Callable[[], None], name: str) -> threading.Thread:
    """Start `target` on a new thread; return once it has returned or has called a
    `threading` wait or join (a `Condition`, an `Event`, a `Thread.join`).

    From then on the thread is finished, or waits for something only another thread can
    do: a test orders threads this way without sleeping. A profiler, set in that thread
    only, spots the call, so the code under test needs no hook.
    """
    parked = threading.Event()

    def spot_waits(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        in_threading = code.co_filename == threading.__file__
        if event == "call" and in_threading and code.co_name in ("wait", "join"):
            parked.set()

    def run() -> None:
        sys.setprofile(spot_waits)
        try:
            target()
        finally:
            sys.setprofile(None)
            parked.set()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    assert parked.wait(WAIT_S), f"{name} neither returned nor waited"
    return thread


def join_all(*threads: threading.Thread) -> None:
    """Join `threads`; fail if one is still running after `WAIT_S` (a deadlock)."""
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), f"{thread.name} never finished"


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


def on_another_device(info: os.stat_result) -> os.stat_result:
    """Return `info` moved to another device, same inode number: a file of another
    filesystem (one mounted over the directory, say) whose inode number happens to match."""
    fields = list(info[:10])  # st_mode, st_ino, st_dev, ...: the integer fields
    fields[2] += 1
    return os.stat_result(fields)
