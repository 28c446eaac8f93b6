"""`DiskTier.close` cut short by a Ctrl-C: what it did not finish is finished by a retry,
and an interrupt in the slot file's sync (a long one for a page-cache tier) still syncs
and closes the manifest (the transfer worker detaches its disk tier before closing it,
so nobody retries that close)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from itertools import count
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np
import pytest
from storage_helpers import num_open_fds

import kvtier.storage
from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, DiskTier, DiskTierConfig, disk_tier_close, file_lock
from kvtier.storage.manifest_log import ManifestLog
from kvtier.storage.slot_file import SlotFile, is_locked

pytestmark = pytest.mark.timeout(120)

SLOT = 4096
# The system calls a close makes; a signal arriving during one is raised once it returns.
CALLS = ("fsync", "fdatasync", "close", "unlink", "open", "write", "replace", "fstat", "lstat")
STORAGE = os.path.dirname(kvtier.storage.__file__)
# The lines a close runs in these (deeper ones, such as a lock's `with`, are CPython's).
CODES = (
    DiskTier._close_now.__code__,
    disk_tier_close.close_files.__code__,
    disk_tier_close._sync_and_close_log.__code__,
    SlotFile._close_now.__code__,
    ManifestLog._close_now.__code__,
    file_lock.remove_held_file.__code__,
    file_lock._names_held_file.__code__,
)
RETRY_TIMEOUT_S = 10.0


class InterruptError(BaseException):
    """Stands in for KeyboardInterrupt (which pytest would take as a request to stop)."""


def rec(i: int) -> SlotRecord:
    return SlotRecord(int(i).to_bytes(4, "little") * 9, 4)


def written_tier(directory: Path, persistent: bool) -> DiskTier:
    """A tier holding slots 0 and 1, recorded in its manifest when `persistent`."""
    directory.mkdir()
    config = DiskTierConfig(
        str(directory / "rank0.slots"),
        num_slots=4,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        fingerprint="fp" if persistent else None,
    )
    tier = DiskTier(config)
    buffer = tier.store_buffers[0]
    buffer.tensor[:2] = 7
    records = [rec(0), rec(1)] if persistent else None
    tier.write_slots(buffer, np.array([0, 1]), records).result()
    return tier


def problems_after(tier: DiskTier, fds_before: int) -> list[str]:
    """What a finished close left wrong: a held lock or descriptor, a slot file left, a
    manifest that does not restore the two slots."""
    problems = []
    path = tier.config.path
    if is_locked(path):
        problems.append("the slot file is still locked")
    if num_open_fds() != fds_before:
        problems.append(f"{num_open_fds() - fds_before} descriptors left open")
    if not tier.persistent:
        if os.path.exists(path):
            problems.append("the slot file was not removed")
        return problems
    try:
        again = DiskTier(tier.config)
    except OSError as exc:
        return [*problems, f"cannot reopen it: {exc!r}"]
    restored = [slot for slot, _ in again.recovered_slots()]
    again.close()
    if restored != [0, 1]:
        problems.append(f"restored slots {restored}")
    return problems


def retry_elsewhere(tier: DiskTier) -> str | None:
    """Close `tier` again from a new thread (a close cut short may be retried from any);
    return what went wrong: what it raised, or that it hangs (still running after
    RETRY_TIMEOUT_S)."""
    raised: list[BaseException] = []

    def close() -> None:
        try:
            tier.close()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=close, daemon=True)  # a hang fails, never blocks, the test
    thread.start()
    thread.join(RETRY_TIMEOUT_S)
    if thread.is_alive():
        tier._finalizer.detach()  # or the interpreter's exit would wait for the hung close
        return "the retry hangs"
    return f"the retry raised {raised[0]!r}" if raised else None


def cut_short_at_each(
    tmp_path: Path, persistent: bool, arm: Callable[[int], Callable[[], str | None]]
) -> None:
    """Close a tier with the n-th interrupt point armed (`arm(n)` returns the disarm
    call, which tells where the interrupt struck), close it again from another thread,
    and check what is left, for n = 1, 2, ... until a close runs past the last point."""
    failures = []
    for n in count(1):
        tier = written_tier(tmp_path / str(n), persistent)
        fds_before = num_open_fds() - 2  # the tier's slot file and manifest
        if not persistent:
            fds_before += 1
        disarm = arm(n)
        try:
            tier.close()
        except InterruptError:
            pass
        finally:
            where = disarm()
        if where is None:  # past the last point
            assert n > 2, f"only {n - 1} points"
            assert not problems_after(tier, fds_before)
            break
        failure = retry_elsewhere(tier)
        problems = [failure] if failure else problems_after(tier, fds_before)
        if problems:
            failures.append(f"interrupted at {n} ({where}): {problems}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "plain"])
def test_a_close_cut_short_after_any_system_call_is_finished_by_a_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persistent: bool
) -> None:
    """Regression: a Ctrl-C right after the slot file's fsync skipped the manifest's sync
    and close, and the retry did nothing (the tier's finalizer was already detached): the
    manifest's descriptor stayed open for good."""

    def arm(n: int) -> Callable[[], str | None]:
        seen: list[str] = []

        def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                result = real(*args, **kwargs)
                if not sys._getframe(1).f_code.co_filename.startswith(STORAGE):
                    return result  # pytest's, or a collection's
                seen.append(f"os.{name}")
                if len(seen) == n:
                    raise InterruptError
                return result

            return call

        for name in CALLS:
            monkeypatch.setattr(os, name, wrap(name, getattr(os, name)))

        def disarm() -> str | None:
            monkeypatch.undo()
            return seen[n - 1] if len(seen) >= n else None

        return disarm

    cut_short_at_each(tmp_path, persistent, arm)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "plain"])
def test_a_close_cut_short_at_any_line_is_finished_by_a_retry(
    tmp_path: Path, persistent: bool
) -> None:
    """Regression: `DiskTier._close_now` and `SlotFile._close_now` detached their
    finalizers before closing, so a Ctrl-C after the detach left the files (and the slot
    file's lock) open for good: the retry found nothing to do."""

    def arm(n: int) -> Callable[[], str | None]:
        seen: list[str] = []

        def local(frame: FrameType, event: str, arg: object) -> Any:
            if event == "line" and len(seen) < n:
                seen.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                if len(seen) == n:
                    raise InterruptError
            return local

        def tracer(frame: FrameType, event: str, arg: object) -> Any:
            code: CodeType = frame.f_code
            return local if code in CODES else None

        previous = sys.gettrace()
        sys.settrace(tracer)

        def disarm() -> str | None:
            sys.settrace(previous)
            return seen[n - 1] if len(seen) >= n else None

        return disarm

    cut_short_at_each(tmp_path, persistent, arm)


def test_an_interrupted_slot_file_sync_still_syncs_and_closes_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a Ctrl-C in the slot file's sync at close left the manifest open and
    unsynced (its descriptor never closed, its newest records not durable)."""
    tier = written_tier(tmp_path / "tier", persistent=True)
    log = tier._records.log
    assert log is not None
    manifest_syncs: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target == tier.path:
            raise InterruptError
        if target == log.path:
            manifest_syncs.append(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(InterruptError):
        tier.close()
    monkeypatch.undo()
    assert len(manifest_syncs) == 1
    assert not log.is_open
    assert not is_locked(tier.path)
