"""`rewrite_manifest` on its own: a write that makes no progress fails the rewrite (it
never spins), and the new file is this user's alone (0600) whatever the umask: a
manifest group or others may write is never trusted by the next open."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

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
