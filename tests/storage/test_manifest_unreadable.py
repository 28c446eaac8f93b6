"""An unreadable sector in the manifest (EIO) costs only the records in its page.

Regression (review): a read that failed with EIO failed the whole replay, and the open
then discarded the tier (slot file and manifest) as if the header did not match.
"""

from __future__ import annotations

import errno
import io
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.storage import manifest_read
from kvtier.storage.manifest import ManifestEntry, ManifestIdentity, read_manifest
from kvtier.storage.manifest_format import encode_put

NUM_SLOTS = 1024  # about 64 KiB of records
IDENTITY = ManifestIdentity("model-a|kv|sha256:0", NUM_SLOTS, 4096, "kv[0]:4096")
PAGE = 4096


def entry(slot: int) -> ManifestEntry:
    return ManifestEntry(1000 + slot, SlotRecord(slot.to_bytes(4, "little") * 9, 16))


class UnreadableSectors(io.FileIO):
    """A file whose 512-byte sectors at `bad` fail every read with EIO (a read that
    reaches one returns what lies before it first, as a disk does)."""

    bad: frozenset[int] = frozenset()

    def readinto(self, buffer: Any) -> int:
        start = self.tell()
        if any(sector <= start < sector + 512 for sector in self.bad):
            raise OSError(errno.EIO, "Input/output error")
        ahead = [sector for sector in self.bad if start < sector < start + len(buffer)]
        if ahead:
            buffer = memoryview(buffer)[: min(ahead) - start]
        return super().readinto(buffer)


def write_manifest(path: Path) -> list[tuple[int, int]]:
    """Write a put per slot; return each record's [start, end) file offsets."""
    body, spans = bytearray(IDENTITY.encode()), []
    for slot in range(NUM_SLOTS):
        record = encode_put(slot, entry(slot))
        spans.append((len(body), len(body) + len(record)))
        body += record
    path.write_bytes(bytes(body))
    return spans


def replay_with_bad(
    path: Path, bad: set[int], monkeypatch: pytest.MonkeyPatch
) -> dict[int, ManifestEntry]:
    UnreadableSectors.bad = frozenset(bad)

    def fdopen(fd: int, mode: str, buffering: int = -1) -> io.BufferedReader:
        assert mode == "rb"
        return io.BufferedReader(UnreadableSectors(fd, "rb"), buffer_size=buffering)

    real_pread = os.pread

    def pread(fd: int, length: int, offset: int) -> bytes:
        """A page read fails whole when any of its sectors is bad (as Linux's do)."""
        if any(offset - 511 <= sector < offset + length for sector in bad):
            raise OSError(errno.EIO, "Input/output error")
        return real_pread(fd, length, offset)

    monkeypatch.setattr(manifest_read.os, "fdopen", fdopen)  # the os module itself
    monkeypatch.setattr(manifest_read.os, "pread", pread)
    return read_manifest(str(path), IDENTITY)


@pytest.mark.parametrize("num_bad", [1, 3])
def test_an_unreadable_sector_costs_only_the_records_of_its_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, num_bad: int
) -> None:
    spans = write_manifest(tmp_path / "m")
    size = spans[-1][1]
    bad = {((size // 4) // 512 + 17 * i) * 512 for i in range(num_bad)}  # 8.5 KiB apart
    pages = {sector // PAGE for sector in bad}
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.manifest"):
        live = replay_with_bad(tmp_path / "m", bad, monkeypatch)
    touched = {
        slot
        for slot, (start, end) in enumerate(spans)
        if any(start < (page + 1) * PAGE and end > page * PAGE for page in pages)
    }
    assert len(pages) == num_bad
    assert all(page * PAGE < size for page in pages)
    assert touched
    assert live == {slot: entry(slot) for slot in range(NUM_SLOTS) if slot not in touched}
    assert f"{len(pages) * PAGE} bytes could not be read (I/O error)" in caplog.text


def test_another_read_error_still_fails_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only EIO is a damaged sector; anything else is no manifest to trust."""
    write_manifest(tmp_path / "m")

    class Broken(io.FileIO):
        def readinto(self, buffer: Any) -> int:
            if self.tell() > 0:
                raise OSError(errno.EBADF, "Bad file descriptor")
            return super().readinto(buffer)

    def fdopen(fd: int, mode: str, buffering: int = -1) -> io.BufferedReader:
        return io.BufferedReader(Broken(fd, "rb"), buffer_size=buffering)

    monkeypatch.setattr(manifest_read.os, "fdopen", fdopen)
    with pytest.raises(manifest_read.ManifestError, match="cannot read the manifest"):
        read_manifest(str(tmp_path / "m"), IDENTITY)


def test_more_than_a_mib_unreadable_fails_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing disk: past 1 MiB of unreadable pages the replay gives up (the open then
    discards the tier) rather than wait out a failed read per page."""
    body = bytearray(IDENTITY.encode())
    slot = 0
    while len(body) < (1 << 20) + 64 * PAGE:
        body += encode_put(slot % NUM_SLOTS, entry(slot % NUM_SLOTS))
        slot += 1
    path = tmp_path / "m"
    path.write_bytes(bytes(body))
    bad = set(range(PAGE, len(body), 512))  # every sector after the header's page
    with pytest.raises(manifest_read.ManifestError, match="cannot read the manifest"):
        replay_with_bad(path, bad, monkeypatch)
