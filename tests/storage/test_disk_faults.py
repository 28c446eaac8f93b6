"""Faults around a disk tier's files: odd objects at its paths, a huge manifest,
a full disk or an I/O error while the manifest is written or synced, slot paths that
would share a manifest, a second tier beside a live one, a directory made at a manifest
path during the open, and a slot file that cannot be removed at close."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.storage import (
    DiskIOMode,
    DiskTier,
    DiskTierBusyError,
    DiskTierConfig,
    SlotFile,
    disk_tier,
    manifest_path_for,
)
from kvtier.storage.file_lock import is_locked
from kvtier.storage.manifest import read_manifest

SLOT = 4096
RECORD = SlotRecord(b"key-3", 16)

pytestmark = pytest.mark.timeout(60)


def config(tmp_path: Path, fingerprint: str | None = "fp") -> DiskTierConfig:
    return DiskTierConfig(
        str(tmp_path / "kvtier-rank0.slots"),
        num_slots=8,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        batch_bytes=2 * SLOT,
        fingerprint=fingerprint,
    )


def tier_with_slot_3(tmp_path: Path) -> DiskTier:
    """Return an open persistent tier whose slot 3 holds `RECORD`."""
    tier = DiskTier(config(tmp_path))
    buffer = tier.store_buffers[0]
    buffer.tensor[0] = 7
    tier.write_slots(buffer, np.array([3]), [RECORD]).result()
    return tier


def manifest(tmp_path: Path) -> Path:
    return tmp_path / "kvtier-rank0.manifest"


def open_paths(directory: Path) -> list[str]:
    """Return the paths under `directory` this process holds open."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [p for p in paths if p.startswith(str(directory))]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("suffix", [".manifest", ".manifest.tmp"])
def test_a_fifo_at_a_manifest_path_never_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, suffix: str
) -> None:
    """A FIFO where the manifest or its temporary file goes is never waited on: a FIFO
    manifest is discarded like a corrupt one (warning naming it), a FIFO `.tmp` replaced."""
    tier_with_slot_3(tmp_path).close()
    fifo = tmp_path / f"kvtier-rank0{suffix}"
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(config(tmp_path))
    if suffix == ".manifest":
        assert tier.recovered_slots() == []
        assert "not a regular file" in caplog.text
        assert str(fifo) in caplog.text
    else:
        assert tier.recovered_slots() == [(3, RECORD)]
    tier.check_invariants()
    tier.close()
    assert sorted(os.listdir(tmp_path)) == ["kvtier-rank0.manifest", "kvtier-rank0.slots"]
    assert manifest(tmp_path).is_file()


@pytest.mark.parametrize("suffix", [".manifest", ".manifest.tmp"])
@pytest.mark.parametrize("fingerprint", ["fp", None])
@pytest.mark.parametrize("at_rest", [False, True])
def test_a_directory_at_a_manifest_path_is_refused_at_open(
    tmp_path: Path, suffix: str, fingerprint: str | None, at_rest: bool
) -> None:
    """Regression: a directory where the manifest (or its temporary file) goes raised a
    bare IsADirectoryError when the tier wrote or removed the manifest. The open now
    fails first with an OSError naming the path and saying what to do, persistent or not,
    beside a persistent tier's files at rest or none, and touches nothing."""
    if at_rest:
        tier_with_slot_3(tmp_path).close()
    directory = tmp_path / f"kvtier-rank0{suffix}"
    directory.unlink(missing_ok=True)
    directory.mkdir()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(OSError, match="is a directory, not a regular file; remove it") as info:
        DiskTier(config(tmp_path, fingerprint))
    assert info.value.errno == errno.EINVAL
    assert info.value.filename == str(directory)
    assert sorted(os.listdir(tmp_path)) == before
    assert open_paths(tmp_path) == []
    directory.rmdir()
    tier = DiskTier(config(tmp_path))
    assert tier.recovered_slots() == ([(3, RECORD)] if at_rest and suffix != ".manifest" else [])
    tier.close()


def test_a_huge_manifest_is_replayed_in_bounded_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest grown to 256 MiB (sparse here) is read a buffer at a time, never whole;
    the zeros after its records are scanned for a valid record (there is none) and end
    the replay with a warning naming the file and size."""
    tier_with_slot_3(tmp_path).close()
    size = 256 << 20
    os.truncate(manifest(tmp_path), size)
    identity = config(tmp_path).identity
    assert identity is not None
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING):
            live = read_manifest(str(manifest(tmp_path)), identity)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    assert {slot: entry.record for slot, entry in live.items()} == {3: RECORD}
    assert f"of {size};" in caplog.text
    assert str(manifest(tmp_path)) in caplog.text


@pytest.mark.parametrize(("fault", "code"), [("write", errno.ENOSPC), ("fsync", errno.EIO)])
def test_a_failed_manifest_rewrite_at_open_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, code: int
) -> None:
    """A full disk or an I/O error while the manifest is rewritten at open: OSError with
    its errno, naming the file; the manifest is as it was, nothing is left open, and the
    next open recovers the cache."""
    tier_with_slot_3(tmp_path).close()
    before = manifest(tmp_path).read_bytes()

    def fail(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, fault, fail)
    with pytest.raises(OSError) as info:
        DiskTier(config(tmp_path))
    monkeypatch.undo()
    assert info.value.errno == code
    assert info.value.filename == f"{manifest(tmp_path)}.tmp"
    assert manifest(tmp_path).read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["kvtier-rank0.manifest", "kvtier-rank0.slots"]
    assert open_paths(tmp_path) == []
    tier = DiskTier(config(tmp_path))
    assert tier.recovered_slots() == [(3, RECORD)]
    tier.close()


@pytest.mark.parametrize("failing", ["slots", "manifest"])
def test_a_failed_sync_at_close_is_logged_and_closes_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failing: str
) -> None:
    """EIO from fsync of the slot file or the manifest at close: no exception, an error
    naming the file, both files closed, the lock released, and the manifest removed so
    the next open starts empty."""
    tier = tier_with_slot_3(tmp_path)
    target = str(tmp_path / f"kvtier-rank0.{failing}")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.path.samestat(os.fstat(fd), os.stat(target)):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with caplog.at_level(logging.ERROR):
        tier.close()
    monkeypatch.undo()
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert target in caplog.text
    assert "Input/output error" in caplog.text
    tier.check_invariants()
    assert open_paths(tmp_path) == []
    assert not manifest(tmp_path).exists()
    tier = DiskTier(config(tmp_path))
    assert tier.recovered_slots() == []
    tier.close()


def test_distinct_slot_paths_never_share_a_manifest(tmp_path: Path) -> None:
    """A slot path must end in `.slots`, its manifest replaces that with `.manifest`: `x`
    and `x.slots` can no longer share `x.manifest`, and no slot file takes the name of a
    manifest or its `.tmp`."""
    assert manifest_path_for("/d/kvtier-rank3.slots") == "/d/kvtier-rank3.manifest"
    for bad in ("/d/x", "/d/x.manifest", "/d/x.manifest.tmp", "/d/x.slots.tmp"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            manifest_path_for(bad)
        with pytest.raises(ValueError, match=r"must end in '\.slots'"):
            DiskTierConfig(bad, num_slots=4, bytes_per_slot=SLOT)


def test_a_non_persistent_tier_beside_a_live_persistent_one_is_told_it_is_in_use(
    tmp_path: Path,
) -> None:
    """A live persistent tier's files are in use (do not remove them); once it has
    closed they are a cache at rest that disk_persist would reuse."""
    tier = tier_with_slot_3(tmp_path)
    before = manifest(tmp_path).read_bytes()
    with pytest.raises(DiskTierBusyError, match="in use by another process") as info:
        DiskTier(config(tmp_path, fingerprint=None))
    assert "do not remove" in str(info.value)
    assert info.value.filename == str(tmp_path / "kvtier-rank0.slots")
    assert manifest(tmp_path).read_bytes() == before
    tier.check_invariants()
    tier.close()
    with pytest.raises(FileExistsError, match="remove both files"):
        DiskTier(config(tmp_path, fingerprint=None))
    tier = DiskTier(config(tmp_path))
    assert tier.recovered_slots() == [(3, RECORD)]
    tier.close()


def make_directory_after_the_slot_file_opens(
    monkeypatch: pytest.MonkeyPatch, directory: Path
) -> None:
    """Make a directory appear at `directory` (replacing a file there) once the tier's
    slot file is open: after the open checked the manifest paths, before it writes or
    removes the manifest."""

    def open_then_make_directory(*args: Any, **kwargs: Any) -> SlotFile:
        slot_file = SlotFile(*args, **kwargs)
        directory.unlink(missing_ok=True)
        directory.mkdir()
        return slot_file

    monkeypatch.setattr(disk_tier, "SlotFile", open_then_make_directory)


@pytest.mark.parametrize(
    ("suffix", "fingerprint", "at_rest"),
    [
        (".manifest", None, False),  # a leftover manifest is removed
        (".manifest", "fp", False),  # the new manifest is renamed over it
        (".manifest", "fp", True),  # a manifest that is no regular file is discarded
        (".manifest.tmp", "fp", False),  # the temporary file is removed, then created
        (".manifest.tmp", "fp", True),
    ],
)
def test_a_directory_made_at_a_manifest_path_after_the_check_is_named(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    suffix: str,
    fingerprint: str | None,
    at_rest: bool,
) -> None:
    """Regression: a directory made where the manifest or its temporary file goes after
    the open checked those paths made the open fail with a bare IsADirectoryError. The
    error is now the check's (naming the path, saying what to do), the slot file is
    closed and unlocked, and once the directory is gone the tier opens at the same path."""
    if at_rest:
        tier_with_slot_3(tmp_path).close()
    directory = tmp_path / f"kvtier-rank0{suffix}"
    make_directory_after_the_slot_file_opens(monkeypatch, directory)
    with pytest.raises(OSError, match="is a directory, not a regular file; remove it") as info:
        DiskTier(config(tmp_path, fingerprint))
    monkeypatch.undo()
    assert info.value.errno == errno.EINVAL
    assert info.value.filename == str(directory)
    assert open_paths(tmp_path) == []
    assert not is_locked(str(tmp_path / "kvtier-rank0.slots"))
    directory.rmdir()
    tier = DiskTier(config(tmp_path))
    assert tier.recovered_slots() == ([(3, RECORD)] if at_rest and suffix != ".manifest" else [])
    tier.close()


def test_a_slot_file_that_cannot_be_removed_at_close_is_left_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: close() of a non-persistent tier raised when its slot file could not be
    removed, although a close never raises for a failed sync. It now logs a warning
    naming the file and the error, closes everything and releases the lock; the next open
    replaces the leftover file."""
    tier = DiskTier(config(tmp_path, fingerprint=None))
    slots = str(tmp_path / "kvtier-rank0.slots")
    real_unlink = os.unlink

    def unlink(name: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(name) == slots:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), slots)
        real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level(logging.WARNING):
        tier.close()
    monkeypatch.undo()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert slots in caplog.text
    assert "Permission denied" in caplog.text
    tier.check_invariants()
    tier.close()
    assert open_paths(tmp_path) == []
    assert not is_locked(slots)
    assert os.listdir(tmp_path) == ["kvtier-rank0.slots"]
    tier = DiskTier(config(tmp_path, fingerprint=None))
    tier.close()
    assert os.listdir(tmp_path) == []


def test_a_failed_open_leaves_nothing_open_even_when_closing_fails_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: staging buffers were allocated after the files were opened, and when
    that failed the cleanup closed the manifest first: a failing fsync there raised its
    own error in place of the allocation's and left the slot file open and locked. The
    buffers are now allocated before any file is opened: the allocation's error is
    raised, nothing is open, and the files at rest are as they were."""
    tier_with_slot_3(tmp_path).close()
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}

    failed: list[str] = []
    real_fsync = os.fsync

    def no_memory(*args: Any, **kwargs: Any) -> None:
        failed.append("allocate")
        raise MemoryError("staging buffer")

    def failing_fsync(fd: int) -> None:
        if failed:  # only the cleanup's: the open itself goes well
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(disk_tier.StagingBuffer, "allocate", no_memory)
    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(MemoryError, match="staging buffer"):
        DiskTier(config(tmp_path))
    monkeypatch.undo()
    assert open_paths(tmp_path) == []
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before
    tier = DiskTier(config(tmp_path))
    assert tier.recovered_slots() == [(3, RECORD)]
    tier.close()
