"""A persistent disk tier driven by random operations, faults and restarts, against a model.

Writes (with or without records, some tombstoned up front as the disk mover does), reads,
`forget`, `end_persistence`, bit rot in the slot file, and faults armed for the next data
write, slot file sync, manifest append or manifest sync. A clean restart must recover
exactly the records the model holds (none once persistence ended or a manifest sync
failed); a crash (the process killed, or power lost: each slot as last synced or as
written, the manifest as last synced plus any prefix of what was appended since) may
lose records but never brings back one `forget` dropped, and every recovered slot that
loads returns exactly the bytes written with its record. Every read returns the bytes
of the slot's last successful write, or fails naming exactly the slots that hold none.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvtier.storage.disk_tier as disk_tier_module
from example_counts import scaled_examples
from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, DiskTier, DiskTierConfig
from kvtier.storage.manifest import open_manifest
from kvtier.storage.slot_file import BadSlotsError, DiskIOError

NUM_SLOTS = 3
SLOT = 64
TOMBSTONE_KIND = 2

pytestmark = pytest.mark.timeout(180)

slot_sets = st.lists(st.integers(0, NUM_SLOTS - 1), min_size=1, max_size=NUM_SLOTS, unique=True)


def rec(n: int) -> SlotRecord:
    return SlotRecord(n.to_bytes(8, "little") * 3, 16)


def fill(n: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


class FaultyDisk:
    """The tier's files as the device holds them, and faults armed for their next call.

    Wraps `os.write` / `os.fsync` / `os.fdatasync` (and is the tier's `FileIO`): keeps the
    slot file as of its last sync and each manifest file as of its last fsync, and which
    manifest file its name durably stands for (see `crash_image`)."""

    def __init__(self, directory: Path) -> None:
        self.slots = directory / "rank0.slots"
        self.manifest = directory / "rank0.manifest"
        self.directory = str(directory)
        self.armed: set[str] = set()
        self.fail_write_after: int | None = None  # data pwrites that succeed before one fails
        self.consumed: list[tuple[str, int]] = []
        self.slots_synced = b""
        self.synced: dict[int, bytes] = {}
        self.named: int | None = None
        self._write, self._fsync, self._fdatasync = os.write, os.fsync, os.fdatasync

    def opened(self) -> None:
        """The tier just opened: what is on the files now is durable."""
        self.slots_synced = self.slots.read_bytes()
        self.named = self.manifest.stat().st_ino
        self.synced = {self.named: self.manifest.read_bytes()}

    def _target(self, fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if "append" in self.armed and self._target(fd) == str(self.manifest):
            self.armed.discard("append")
            self.consumed.append(("append", bytes(data[:1])[0]))
            raise OSError(errno.ENOSPC, "no space (injected)")
        return self._write(fd, data)

    def fsync(self, fd: int) -> None:
        target = self._target(fd)
        if "msync" in self.armed and target == str(self.manifest):
            self.armed.discard("msync")
            self.consumed.append(("msync", 0))
            raise OSError(errno.EIO, "manifest fsync failed (injected)")
        self._fsync(fd)
        self._note_sync(fd, target)

    def fdatasync(self, fd: int) -> None:
        target = self._target(fd)
        if "dsync" in self.armed and target == str(self.slots):
            self.armed.discard("dsync")
            self.consumed.append(("dsync", 0))
            raise OSError(errno.EIO, "slot file sync failed (injected)")
        self._fdatasync(fd)
        self._note_sync(fd, target)

    def _note_sync(self, fd: int, target: str) -> None:
        if target == self.directory:
            self.named = self.manifest.stat().st_ino if self.manifest.exists() else None
        elif target == str(self.slots):
            self.slots_synced = self.slots.read_bytes()
        elif target in (str(self.manifest), f"{self.manifest}.tmp"):
            with open(f"/proc/self/fd/{fd}", "rb") as file:
                self.synced[os.fstat(fd).st_ino] = file.read()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if self.fail_write_after is not None:
            if self.fail_write_after == 0:
                self.fail_write_after = None
                self.consumed.append(("data", 0))
                raise OSError(errno.EIO, "write failed (injected)")
            self.fail_write_after -= 1
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, into: memoryview, offset: int) -> int:
        return os.preadv(fd, [into], offset)

    def corrupt(self, slot: int) -> None:
        """Change a byte of `slot` on the device (bit rot: synced or not); by one, so that
        no run of fewer than 256 changes restores it."""
        offset = slot * SLOT + 7
        with open(self.slots, "r+b") as file:
            file.seek(offset)
            byte = (file.read(1)[0] + 1) % 256
            file.seek(offset)
            file.write(bytes([byte]))
        synced = bytearray(self.slots_synced)
        synced[offset] = (synced[offset] + 1) % 256
        self.slots_synced = bytes(synced)


class DiskTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp())
        self.disk = FaultyDisk(self.directory)
        self.patch = pytest.MonkeyPatch()
        for name in ("write", "fsync", "fdatasync"):
            self.patch.setattr(os, name, getattr(self.disk, name))
        compacting = functools.partial(open_manifest, compact_floor=6)
        self.patch.setattr(disk_tier_module, "open_manifest", compacting)
        self.config = DiskTierConfig(
            str(self.disk.slots), NUM_SLOTS, SLOT, DiskIOMode.PAGE_CACHE, fingerprint="fp"
        )
        self.counter = 0
        self.expect: dict[int, bytes] = {}  # slot -> bytes a read returns (else it fails)
        self.records: dict[int, int] = {}  # slot -> record number in the manifest
        self.bad_dropped: set[tuple[int, int]] = set()  # unsynced tombstones of bad reads
        self.rotted: set[tuple[int, int]] = set()  # records whose slot was corrupted since
        self.recovered: dict[int, int] = {}  # what `recovered_slots` still lists
        self.ended = self.doomed = False
        self.tier = self._open()

    def _open(self) -> DiskTier:
        tier = DiskTier(self.config, self.disk)
        self.disk.opened()
        self.ended = self.doomed = False
        self.bad_dropped.clear()
        return tier

    def teardown(self) -> None:
        self.disk.armed.clear()
        self.disk.fail_write_after = None
        self.tier.close()
        self.patch.undo()
        shutil.rmtree(self.directory)

    def _take_faults(self, slots: list[int]) -> bool:
        """Apply the faults the last operation consumed; return True if a data write failed."""
        failed = False
        for fault, kind in self.disk.consumed:
            if fault == "data":
                failed = True
            elif fault == "append" and kind == TOMBSTONE_KIND:
                self._end()
            elif fault == "msync":  # in a tombstones' sync: ended; in a compaction: later
                self._end(doomed=not self._log_ended())
            else:  # a put append or the commit's data sync: the write's records are lost
                for slot in slots:
                    self.records.pop(slot, None)
        self.disk.consumed.clear()
        if self.doomed and not self.ended and self._log_ended():  # the next sync failed
            self._end()
        return failed

    def _log_ended(self) -> bool:
        log = self.tier._records.log
        return log is not None and log.ended

    def _end(self, doomed: bool = False) -> None:
        self.doomed = self.doomed or doomed
        if not doomed:
            self.ended = True
            self.records.clear()
            self.bad_dropped.clear()
            self.recovered.clear()

    @rule(
        slots=slot_sets,
        with_records=st.booleans(),
        prepared=st.booleans(),
        fault=st.sampled_from([None, None, None, "data0", "data1", "dsync", "append", "msync"]),
    )
    def write(
        self, slots: list[int], with_records: bool, prepared: bool, fault: str | None
    ) -> None:
        if fault in ("data0", "data1"):
            self.disk.fail_write_after = int(fault[-1])
        elif fault is not None:
            self.disk.armed.add(fault)
        numbers = []
        buffer = self.tier.store_buffers[0]
        for row, _ in enumerate(slots):
            self.counter += 1
            numbers.append(self.counter)
            buffer.tensor[row].numpy()[:] = np.frombuffer(fill(self.counter), dtype=np.uint8)
        for slot in slots:  # the old records are dropped whatever happens next
            self._forgotten(slot)
        if prepared:
            self.tier.prepare_overwrite(slots)
        records = [rec(n) for n in numbers] if with_records else None
        ids = np.array(slots, dtype=np.int64)
        try:
            self.tier.write_slots(buffer, ids, records).result()
            written = True
        except DiskIOError:
            written = False
        self.disk.fail_write_after = None
        for slot, n in zip(slots, numbers, strict=True):
            if written:
                self.expect[slot] = fill(n)
                if with_records and not self.ended:
                    self.records[slot] = n
            else:
                self.expect.pop(slot, None)
        if self._take_faults(slots):
            assert not written

    @rule(first=slot_sets, second=slot_sets, records=st.sampled_from([(1, 1), (1, 0), (0, 1)]))
    def write_two_queued(
        self, first: list[int], second: list[int], records: tuple[int, int]
    ) -> None:
        """Queue two writes before waiting (their records share a group commit), and
        forget the other slots while they are queued. No fault: which of the writes
        one would hit depends on how their records were grouped."""
        self.disk.armed.clear()
        futures, written = [], {}
        for k, (slots, with_records) in enumerate(zip((first, second), records, strict=True)):
            buffer = self.tier.store_buffers[k]
            numbers = []
            for row, _ in enumerate(slots):
                self.counter += 1
                numbers.append(self.counter)
                buffer.tensor[row].numpy()[:] = np.frombuffer(fill(self.counter), dtype=np.uint8)
                written[slots[row]] = (self.counter, bool(with_records))
            kept = [rec(n) for n in numbers] if with_records else None
            ids = np.array(slots, dtype=np.int64)
            futures.append(self.tier.write_slots(buffer, ids, kept))
        others = [slot for slot in range(NUM_SLOTS) if slot not in written]
        self.tier.forget(others)
        for future in futures:
            future.result()
        for slot in others:
            self._forgotten(slot)
        for slot, (n, with_records) in written.items():
            self._forgotten(slot)
            self.expect[slot] = fill(n)
            if with_records and not self.ended:
                self.records[slot] = n
        self._take_faults([])

    def _forgotten(self, slot: int) -> None:
        self.records.pop(slot, None)
        self.recovered.pop(slot, None)
        self.bad_dropped = {(s, n) for s, n in self.bad_dropped if s != slot}

    @rule(slots=slot_sets)
    def read(self, slots: list[int]) -> None:
        buffer = self.tier.load_buffers[0]
        try:
            self.tier.read_slots(buffer, np.array(slots, dtype=np.int64)).result()
            bad: tuple[int, ...] = ()
        except BadSlotsError as exc:
            bad = exc.slots
        assert set(bad) == {s for s in slots if s not in self.expect}, (bad, slots)
        for row, slot in enumerate(slots):
            if slot in self.expect:
                assert bytes(buffer.tensor[row].numpy()) == self.expect[slot], slot
        for slot in bad:  # mismatched ones are tombstoned, not synced
            self.recovered.pop(slot, None)
            if slot in self.records:
                self.bad_dropped.add((slot, self.records.pop(slot)))
        self._take_faults([])

    @rule(slot=st.integers(0, NUM_SLOTS - 1))
    def corrupt(self, slot: int) -> None:
        self.disk.corrupt(slot)
        self.expect.pop(slot, None)
        if slot in self.records:
            self.rotted.add((slot, self.records[slot]))

    @rule(slots=slot_sets, fault=st.sampled_from([None, None, "append", "msync"]))
    def forget(self, slots: list[int], fault: str | None) -> None:
        if fault is not None:
            self.disk.armed.add(fault)
        self.tier.forget(slots)
        for slot in slots:
            self._forgotten(slot)
        self._take_faults([])

    @rule()
    def end_persistence(self) -> None:
        self.tier.end_persistence()
        self._end()
        self._take_faults([])

    def _reopen(self) -> dict[int, int]:
        self.tier = self._open()
        recovered = {}
        for slot, record in self.tier.recovered_slots():
            n = int.from_bytes(record.key[:8], "little")
            assert record == rec(n)
            recovered[slot] = n
        return recovered

    @rule()
    def clean_restart(self) -> None:
        self.disk.armed.clear()
        self.tier.close()
        expected = {} if self.ended or self.doomed else dict(self.records)
        recovered = self._reopen()
        assert recovered == expected
        self.records = dict(recovered)
        self.recovered = dict(recovered)
        self.expect = {s: fill(n) for s, n in recovered.items() if (s, n) not in self.rotted}

    @rule(data=st.data(), killed=st.booleans())
    def crash(self, data: st.DataObject, killed: bool) -> None:
        disk = self.disk
        disk.armed.clear()
        written, appended = disk.slots.read_bytes(), disk.manifest.read_bytes()
        if killed:
            slots, manifest = written, appended
        else:
            picks = data.draw(st.lists(st.booleans(), min_size=NUM_SLOTS, max_size=NUM_SLOTS))
            slots = b"".join(
                (written if pick else disk.slots_synced)[i * SLOT : (i + 1) * SLOT]
                for i, pick in enumerate(picks)
            )
            base = disk.synced[disk.named] if disk.named is not None else b""
            tail = appended[len(base) :]
            # Drawn as a share of the tail: its length depends on how writes were grouped.
            share = data.draw(st.integers(0, 8)) / 8
            if disk.named == disk.manifest.stat().st_ino and appended.startswith(base):
                manifest = base + tail[: round(share * len(tail))]
            else:
                manifest = base
        allowed = set(self.records.items()) | self.bad_dropped
        suspect = self.bad_dropped | self.rotted  # may fail their load after the restart
        self.tier.close()
        disk.slots.write_bytes(slots)
        disk.manifest.write_bytes(manifest)
        recovered = self._reopen()
        assert set(recovered.items()) <= allowed, (recovered, allowed)
        if killed and not self.doomed:
            assert set(self.records.items()) <= set(recovered.items())
        self.records, self.recovered, self.expect = {}, dict(recovered), {}
        buffer = self.tier.load_buffers[0]
        for slot, n in recovered.items():
            try:
                self.tier.read_slots(buffer, np.array([slot], dtype=np.int64)).result()
            except BadSlotsError:
                assert (slot, n) in suspect, "a recovered slot fails to load"
                self.recovered.pop(slot)
                self.bad_dropped.add((slot, n))
                continue
            assert bytes(buffer.tensor[0].numpy()) == fill(n), "wrong bytes for a record"
            self.records[slot] = n
            self.expect[slot] = fill(n)

    @invariant()
    def consistent(self) -> None:
        self.tier.check_invariants()
        listed = self.tier.recovered_slots()
        assert {slot: int.from_bytes(r.key[:8], "little") for slot, r in listed} == self.recovered


DiskTierMachine.TestCase.settings = settings(
    max_examples=scaled_examples(100), stateful_step_count=25, deadline=None
)
test_disk_tier_machine = DiskTierMachine.TestCase
