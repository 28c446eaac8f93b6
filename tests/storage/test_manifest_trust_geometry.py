"""`read_manifest` trusts only a manifest of this user that no one else can write
(group-writable counts: its bytes are served as KV), and takes only one of this tier's
exact number of slots (one of a smaller tier is `read_manifest_any_size`'s to resize).
A manifest discarded at open is never left behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_manifest import IDENTITY, close, manifest_of, open_tier_files, rec

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, ManifestIdentity, SlotFile, manifest_log, manifest_read
from kvtier.storage.manifest import (
    ManifestError,
    open_manifest,
    read_manifest,
    read_manifest_any_size,
)
from kvtier.storage.manifest_log import ManifestLog

SMALL = ManifestIdentity("model-a|kv|sha256:0", 5, 4096, "kv[0]:4096")
LARGE = ManifestIdentity("model-a|kv|sha256:0", 8, 4096, "kv[0]:4096")


def manifest(tmp_path: Path) -> str:
    path = str(tmp_path / "m.manifest")
    log = ManifestLog(path, SMALL.encode(), {})
    log.put([1], [1], [SlotRecord(b"one", 4)])
    log.close()
    return path


def test_a_group_writable_manifest_is_not_trusted(tmp_path: Path) -> None:
    path = manifest(tmp_path)
    os.chmod(path, 0o620)
    with pytest.raises(ManifestError, match="writable by group or others"):
        read_manifest(path, SMALL)


def test_a_manifest_another_user_owns_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner check without root (no chown): this process runs as another user."""
    path = manifest(tmp_path)
    owner = os.stat(path).st_uid
    monkeypatch.setattr(manifest_read.os, "geteuid", lambda: owner + 1)
    with pytest.raises(ManifestError, match=f"owned by uid {owner}, not by this user"):
        read_manifest(path, SMALL)


def test_a_manifest_of_fewer_slots_is_refused_by_read_manifest(tmp_path: Path) -> None:
    path = manifest(tmp_path)
    assert sorted(read_manifest(path, SMALL)) == [1]
    with pytest.raises(ManifestError, match="geometry changed: num_slots 5 != 8"):
        read_manifest(path, LARGE)
    live, num_slots = read_manifest_any_size(path, LARGE)
    assert (sorted(live), num_slots) == ([1], 5)


def test_a_discarded_manifest_is_gone_even_when_its_fresh_one_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot file others may write: it is recreated and its manifest discarded. When
    the fresh manifest cannot be written (a full disk) the open fails, and the old one,
    whose records describe the replaced slot file's bytes, must not be left behind."""
    slot_file, log, _ = open_tier_files(tmp_path)
    log.put([1], [1], [rec(1)])
    close(slot_file, log)
    os.chmod(slot_file.path, 0o666)

    def full_disk(path: str, content: bytes, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", path + ".tmp")

    monkeypatch.setattr(manifest_log, "rewrite_manifest", full_disk)
    slots = SlotFile(slot_file.path, 8, 4096, DiskIOMode.PAGE_CACHE, persistent=True)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            open_manifest(slots, IDENTITY)
    finally:
        slots.close()
    assert not manifest_of(tmp_path).exists()
