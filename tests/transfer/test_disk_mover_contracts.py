"""`DiskMover` with a recording disk tier: a store's records follow their slots, a
persistent tier's old records go in one step; and `PartlyLoadedError`'s fields (s33
mutation run on `transfer/disk_mover.py`: each test failed on a mutant that passed
every older test)."""

from __future__ import annotations

import pickle
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvtier.offload.plan import SlotRecord
from kvtier.storage.slot_file import BadSlotsError
from kvtier.transfer.disk_mover import DiskMover, PartlyLoadedError


class RecordingDisk:
    """A disk tier of `batch_slots`-slot batches that records what each call got."""

    def __init__(self, persistent: bool, batch_slots: int = 2) -> None:
        self.persistent, self.batch_slots = persistent, batch_slots
        self.path = "/tier/kvtier-rank0.slots"
        self.store_buffers = [
            SimpleNamespace(tensor=torch.zeros(batch_slots, 16, dtype=torch.uint8))
            for _ in range(2)
        ]
        self.load_buffers = self.store_buffers
        self.calls: list[tuple[Any, ...]] = []

    def prepare_overwrite(self, slots: list[int]) -> None:
        self.calls.append(("prepare_overwrite", slots))

    def write_slots(self, buffer: Any, slot_ids: np.ndarray, records: Any) -> Future[None]:
        keys = None if records is None else [r.key for r in records]
        self.calls.append(("write_slots", slot_ids.tolist(), keys))
        done: Future[None] = Future()
        done.set_result(None)
        return done


class NoCopier:
    def store_to_staging(self, src: Any, src_ids: Any, staging: Any) -> None:
        pass


def _store(disk: RecordingDisk, slot_ids: list[int]) -> None:
    mover = DiskMover(disk, [(0, 16)], torch.uint8)  # type: ignore[arg-type]
    records = [SlotRecord(f"key-of-slot-{s}".encode(), 16) for s in slot_ids]
    src_ids = np.arange(len(slot_ids), dtype=np.int64)
    mover.store(NoCopier(), [torch.zeros(8, 16)], src_ids, np.array(slot_ids), records)  # type: ignore[arg-type]


def test_each_record_is_written_with_its_own_slot() -> None:
    """A store sorts its slots into batches of consecutive writes; each slot's record
    moves with it (a record left at its old place would name another block's key in a
    persistent tier's manifest: after a restart, that key would load the wrong KV)."""
    disk = RecordingDisk(persistent=True)
    _store(disk, [7, 2, 5, 0, 3])
    writes = [call for call in disk.calls if call[0] == "write_slots"]
    assert [slots for _, slots, _ in writes] == [[0, 2], [3, 5], [7]]
    for _, slots, keys in writes:
        assert keys == [f"key-of-slot-{s}".encode() for s in slots]


def test_a_persistent_store_drops_the_old_records_once_before_writing() -> None:
    """The slots' old records are tombstoned for the whole job before its first write
    (one manifest sync), not batch by batch; a tier that keeps no records skips it."""
    disk = RecordingDisk(persistent=True)
    _store(disk, [7, 2, 5, 0, 3])
    assert disk.calls[0] == ("prepare_overwrite", [0, 2, 3, 5, 7])
    assert [call[0] for call in disk.calls[1:]] == ["write_slots"] * 3
    plain = RecordingDisk(persistent=False)
    _store(plain, [1, 0])
    assert [call[0] for call in plain.calls] == ["write_slots"]


def test_a_partly_loaded_error_names_each_bad_slot_once_in_order() -> None:
    error = PartlyLoadedError([9, 3, 9, 1], "bad", "/tier/slots", 5)
    assert error.slots == (1, 3, 9)
    assert error.errno == 5


def test_a_partly_loaded_error_after_one_bad_slot_says_only_its_reads_message() -> None:
    first = BadSlotsError([4], "slot 4 failed its checksum", "/tier/slots")
    one = PartlyLoadedError.after({4}, first, "/tier/slots")
    assert one.strerror == first.strerror
    assert one.errno == first.errno
    several = PartlyLoadedError.after({4, 6}, first, "/tier/slots")
    assert several.strerror == f"{first.strerror}; 2 bad slots in the load: [4, 6]"


def test_a_pickled_partly_loaded_error_keeps_its_time_and_code() -> None:
    """Tensor-parallel workers send it to the scheduler's process whole: the seconds
    its lane timed and the OS error code included."""
    error = PartlyLoadedError([2], "bad", "/tier/slots", 74)
    error.seconds = 0.25
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.slots, copy.errno, copy.filename, copy.seconds) == ((2,), 74, "/tier/slots", 0.25)
