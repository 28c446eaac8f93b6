"""`rewrite_manifest` on its own: a write that makes no progress fails the rewrite (it
never spins); the new file is this user's alone (0600) whatever the umask (a manifest
group or others may write is never trusted by the next open); the descriptor returned
appends; a failure closes it."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from storage_helpers import num_open_fds

from kvtier.storage import manifest_compaction
from kvtier.storage.manifest_compaction import rewrite_manifest

pytestmark = pytest.mark.timeout(60)


def test_a_write_that_makes_no_progress_fails_the_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.manifest"
    path.write_bytes(b"old log")
    calls: list[int] = []

    def write_nothing(fd: int, data: bytes) -> int:
        calls.append(fd)
        assert len(calls) == 1, "the rewrite wrote again after a write of 0 bytes"
        return 0

    monkeypatch.setattr(manifest_compaction.os, "write", write_nothing)
    with pytest.raises(OSError, match="cannot write the new manifest") as info:
        rewrite_manifest(str(path), b"header and records")
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == b"old log"
    assert not (tmp_path / "m.manifest.tmp").exists()


def test_the_new_file_is_this_users_alone_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "m.manifest"
    old_umask = os.umask(0)
    try:
        fd = rewrite_manifest(str(path), b"header and records")
    finally:
        os.umask(old_umask)
    os.close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == b"header and records"


def test_the_descriptor_returned_appends_after_a_cut_back(tmp_path: Path) -> None:
    """`ManifestLog` cuts a short append off again (ftruncate) and appends on through the
    same descriptor: the next record must follow the cut, not a hole of zeros."""
    path = tmp_path / "m.manifest"
    fd = rewrite_manifest(str(path), b"header")
    try:
        os.write(fd, b"torn")
        os.ftruncate(fd, len(b"header"))
        os.write(fd, b"record")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"headerrecord"


def test_a_rename_that_cannot_be_made_durable_leaves_no_descriptor_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(path: str) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(manifest_compaction, "sync_directory", fail)
    before = num_open_fds()
    with pytest.raises(OSError, match="cannot sync the new manifest's directory"):
        rewrite_manifest(str(tmp_path / "m.manifest"), b"header", durable_rename=True)
    assert num_open_fds() == before
