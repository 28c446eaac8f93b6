"""`ManifestLog.close` cut short by an interrupt (KeyboardInterrupt) as its `with` over
the append lock exits, before `__exit__` runs (forced here by a line tracer): the lock
stays taken, yet a retried close finishes and no later call waits for the lock. And one
cut short right after it closed its descriptor: the retry leaves alone the number, open
on another file by then."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from storage_helpers import num_open_fds, on_another_device

from kvtier.offload.plan import SlotRecord
from kvtier.storage import ManifestIdentity
from kvtier.storage.manifest import read_manifest
from kvtier.storage.manifest_log import ManifestLog

pytestmark = pytest.mark.timeout(60)

IDENTITY = ManifestIdentity("model-a|kv|sha256:0", 4, 4096, "kv[0]:4096")
WAIT_S = 10.0


class InterruptError(BaseException):
    """Stands in for KeyboardInterrupt (which pytest would take as a request to stop)."""


def rec(i: int) -> SlotRecord:
    return SlotRecord(int(i).to_bytes(4, "little") * 9, 4)


def close_cut_short_at_its_with_exit(log: ManifestLog) -> None:
    """Close `log` with an interrupt raised at the first line of `_close_now` that runs
    twice: the `with` statement's line, reported again as it exits."""
    code = ManifestLog._close_now.__code__
    seen: set[int] = set()

    def local(frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            if frame.f_lineno in seen:
                raise InterruptError
            seen.add(frame.f_lineno)
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        with pytest.raises(InterruptError):
            log.close()
    finally:
        sys.settrace(None)


def returns_in_a_thread(call: Callable[[], object]) -> bool:
    """Run `call` in a new thread; return False if it is still running after WAIT_S."""
    thread = threading.Thread(target=call, daemon=True)  # a hang fails, never blocks, the test
    thread.start()
    thread.join(WAIT_S)
    return not thread.is_alive()


def test_a_close_cut_short_as_it_releases_the_lock_is_finished_by_a_retry(
    tmp_path: Path,
) -> None:
    """Regression: the interrupt left the lock taken and the descriptor (already taken
    from the log) in a local variable: the retry waited for the lock for good."""
    path = str(tmp_path / "m.manifest")
    fds_before = num_open_fds()
    log = ManifestLog(path, IDENTITY.encode(), {})
    log.put([1, 2], [11, 12], [rec(1), rec(2)])
    close_cut_short_at_its_with_exit(log)
    assert log._lock.locked(), "the interrupt did not strike as the `with` exits"
    assert returns_in_a_thread(log.close), "the retried close hangs"
    assert not log.is_open
    assert num_open_fds() == fds_before
    assert sorted(read_manifest(path, IDENTITY)) == [1, 2]


def test_calls_after_a_close_cut_short_as_it_releases_the_lock_return(tmp_path: Path) -> None:
    """Regression: every call after it waited for the lock for good."""
    log = ManifestLog(str(tmp_path / "m.manifest"), IDENTITY.encode(), {})
    log.put([1, 2], [11, 12], [rec(1), rec(2)])
    close_cut_short_at_its_with_exit(log)
    results: list[object] = []
    calls: list[Callable[[], object]] = [
        lambda: log.put([3], [13], [rec(3)]),
        lambda: log.forget([1]),
        lambda: log.forget([9]),
        log.sync,
        log.end,
        log.close,
    ]
    for call in calls:
        assert returns_in_a_thread(lambda call=call: results.append(call())), call
    assert results == [None, False, True, True, None, None]
    assert log.ended


def test_a_retried_close_leaves_the_closed_number_open_on_another_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(s31, mutant D15) A close cut short right after closing the log's descriptor leaves
    the retry a number that may be open on another file by then: one on another device is
    not the log's, though its inode number is, and is neither synced nor closed."""
    log = ManifestLog(str(tmp_path / "m.manifest"), IDENTITY.encode(), {})
    log_fd = log._fd
    assert log_fd is not None
    logged = os.fstat(log_fd)
    real_close, real_fstat = os.close, os.fstat

    def close_then_interrupt(fd: int) -> None:
        real_close(fd)
        if fd == log_fd:
            raise InterruptError

    with monkeypatch.context() as patch:
        patch.setattr(os, "close", close_then_interrupt)
        with pytest.raises(InterruptError):
            log.close()
    other = tmp_path / "other"
    other.write_bytes(b"")
    fd = os.open(other, os.O_RDONLY)
    if fd != log_fd:  # a lower number was free too: move the file to the closed number,
        with pytest.raises(OSError):  # free still (dup2 would close another thread's file)
            os.fstat(log_fd)
        os.dup2(fd, log_fd)
        os.close(fd)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(
                os, "fstat", lambda n: on_another_device(logged) if n == log_fd else real_fstat(n)
            )
            log.close()
        assert os.path.exists(f"/proc/self/fd/{log_fd}"), "the retry closed another file"
        assert os.fstat(log_fd).st_ino == os.stat(other).st_ino
    finally:
        with contextlib.suppress(OSError):  # closed by the retry when the test fails
            os.close(log_fd)
