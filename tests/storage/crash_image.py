"""`CrashImage` keeps the manifest's bytes as of its last fsync and, at the crash, the slot
file as it is (the page cache may have written back any write); `restore` puts that
image in place of the files, as the device would hold them after the power came back.
Which file the manifest's name stands for is durable only once its directory is synced
too: a rename or a removal not followed by a directory fsync may be undone by the crash
(the image then holds the file the name stood for at the last directory fsync, as last
synced).

`crash_after_next_data_write` takes the image right after a slot write; `write`,
`persisted` and `restart_reads` store, persist and recover records in a `DiskTier`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_manifest_durability import rec, tier_config

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskTier
from kvtier.storage.slot_file import SlotFile


class CrashImage:
    """The files of the tier in `directory` as a crash now would leave them on the device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
        self._directory = directory
        self._slots = directory / "rank0.slots"
        self._manifest = directory / "rank0.manifest"
        names = {str(self._manifest), f"{self._manifest}.tmp"}
        # The synced bytes of each manifest file (by inode), and the inode the manifest's
        # name durably stands for (None: durably removed); the open rewrote and synced it.
        self._synced = {self._manifest.stat().st_ino: self._manifest.read_bytes()}
        self._named: int | None = self._manifest.stat().st_ino
        self.image: tuple[bytes, bytes | None] | None = None
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            real_fsync(fd)
            target = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
            if target == str(directory):
                self._named = self._manifest.stat().st_ino if self._manifest.exists() else None
            elif target in names:
                with open(f"/proc/self/fd/{fd}", "rb") as file:
                    self._synced[os.fstat(fd).st_ino] = file.read()

        monkeypatch.setattr(os, "fsync", fsync)

    @property
    def synced(self) -> bytes | None:
        """The manifest a crash now would leave (None: no manifest)."""
        return None if self._named is None else self._synced[self._named]

    def take(self) -> None:
        """Crash now: the slot file as written so far, the manifest as last synced."""
        self.image = (self._slots.read_bytes(), self.synced)

    def restore(self) -> None:
        """Replace the (closed) tier's files by the image taken at the crash."""
        assert self.image is not None, "no crash was taken"
        slots, manifest = self.image
        self._slots.write_bytes(slots)
        if manifest is None:
            self._manifest.unlink(missing_ok=True)
        else:
            self._manifest.write_bytes(manifest)


def crash_after_next_data_write(monkeypatch: pytest.MonkeyPatch, crash: CrashImage) -> None:
    """Take the crash image right after the tier's next slot write: the data has landed,
    its put record waits for the group commit."""
    real = SlotFile.write

    def write(slot_file: SlotFile, data: memoryview, first_slot: int) -> None:
        real(slot_file, data, first_slot)
        if crash.image is None:
            crash.take()

    monkeypatch.setattr(SlotFile, "write", write)


def write(tier: DiskTier, slot: int, record: SlotRecord, fill: int) -> None:
    buffer = tier.store_buffers[0]
    buffer.tensor[0].fill_(fill)
    tier.write_slots(buffer, np.array([slot], dtype=np.int64), [record]).result()


def restart_reads(tmp_path: Path) -> list[tuple[int, SlotRecord]]:
    """Open the tier on the crashed files; return what it recovered after checking that
    every recovered slot loads (a record describing other bytes fails its checksum)."""
    tier = DiskTier(tier_config(tmp_path))
    try:
        recovered = tier.recovered_slots()
        buffer = tier.load_buffers[0]
        for slot, _ in recovered:
            tier.read_slots(buffer, np.array([slot], dtype=np.int64)).result()
        return recovered
    finally:
        tier.close()


def persisted(tmp_path: Path, records: dict[int, int]) -> DiskTier:
    """Write slot -> record number (bytes filled with it), close, and reopen the tier:
    every record is durable and recovered."""
    tier = DiskTier(tier_config(tmp_path))
    for slot, number in records.items():
        write(tier, slot, rec(number), number)
    tier.close()
    tier = DiskTier(tier_config(tmp_path))
    assert tier.recovered_slots() == [(slot, rec(n)) for slot, n in sorted(records.items())]
    return tier
