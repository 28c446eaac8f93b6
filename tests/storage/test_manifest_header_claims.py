"""A manifest header whose lengths claim more than the file holds, or more than any
header of this tier can be, is refused by `read_manifest` with its own reason (never an
unexpected error, and never a read of what the header claims)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.storage import ManifestIdentity
from kvtier.storage.manifest import ManifestError, read_manifest
from kvtier.storage.manifest_format import HEADER
from kvtier.storage.manifest_log import ManifestLog
from kvtier.storage.manifest_scan import READ_BUFFER

IDENTITY = ManifestIdentity("model-a|kv|sha256:0", 8, 4096, "kv[0]:4096")
LENGTHS_AT = HEADER.size - 8  # layout_len and fp_len, the header's last two u32s


def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "m.manifest"
    log = ManifestLog(str(path), IDENTITY.encode(), {})
    log.put([1], [1], [SlotRecord(b"one", 4)])
    log.close()
    return path


def test_a_header_claiming_more_than_any_header_is_refused_unread(tmp_path: Path) -> None:
    path = manifest(tmp_path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, LENGTHS_AT, READ_BUFFER)  # layout_len: 1 MiB
    path.write_bytes(bytes(data))
    claimed = HEADER.size + READ_BUFFER + len(IDENTITY.fingerprint) + 8
    with pytest.raises(ManifestError, match=f"the header claims {claimed} B, this tier's is"):
        read_manifest(str(path), IDENTITY)


@pytest.mark.parametrize("keep", [HEADER.size, HEADER.size + 5, len(IDENTITY.encode()) - 1])
def test_a_header_cut_short_is_refused(tmp_path: Path, keep: int) -> None:
    """The file ends inside the layout, the fingerprint or the header's checksum."""
    path = manifest(tmp_path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ManifestError, match="the manifest header is cut short"):
        read_manifest(str(path), IDENTITY)
