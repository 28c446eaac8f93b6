"""What crosses between processes pickles whole: vLLM's tensor-parallel workers run in
other processes, so a worker's errors and reports, and the scheduler's plans, must come
back from `pickle` with every field (the bad slots above all)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, TypeVar

import pytest
from test_worker_bad_slots import SLOT_KV, config, corrupt_slot
from transfer_helpers import fill_random, job, kv_per_layer, make_worker, run_plan

from kvtier.engine.runner import KVCacheTooLargeError
from kvtier.offload.plan import SlotRecord, Tier, TransferJob, TransferPlan, WorkerReport
from kvtier.storage.slot_file import BadSlotsError, DiskIOError
from kvtier.transfer.disk_mover import DiskMover, PartlyLoadedError

T = TypeVar("T")


def round_trip(value: T) -> T:
    copy: T = pickle.loads(pickle.dumps(value))
    assert type(copy) is type(value)
    return copy


def test_bad_slots_error_pickles_with_its_slots() -> None:
    error = BadSlotsError([7, 2, 5], "slot 2 fails its checksum", "/tier/rank0.slots")
    copy = round_trip(error)
    assert copy.slots == (2, 5, 7)
    assert (copy.errno, copy.strerror, copy.filename) == (
        error.errno,
        error.strerror,
        error.filename,
    )
    assert str(copy) == str(error)
    assert isinstance(copy, DiskIOError)


def test_partly_loaded_error_of_a_real_load_pickles_with_its_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slots 2 and 5 of a six-slot disk load are corrupted: the worker's mover raises
    `PartlyLoadedError` naming both, and so does its pickled copy."""
    raised: list[BaseException] = []
    load = DiskMover.load

    def recording(self: DiskMover, *args: Any) -> None:
        try:
            load(self, *args)
        except DiskIOError as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(DiskMover, "load", recording)
    kv = kv_per_layer(2, 32, SLOT_KV)
    fill_random(kv, seed=41)
    with make_worker(config(tmp_path, 2), kv) as w:
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5]))
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 2)
        corrupt_slot(w.disk_path, 5)
        report = run_plan(w, job(2, Tier.DISK, Tier.GPU, [0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]))
    assert report.bad_blocks == {2: frozenset({2, 5})}
    (error,) = raised
    assert isinstance(error, PartlyLoadedError)
    copy = round_trip(error)
    assert copy.slots == error.slots == (2, 5)
    assert (copy.errno, copy.strerror, copy.filename) == (
        error.errno,
        error.strerror,
        error.filename,
    )
    assert str(copy) == str(error)


def test_kv_cache_too_large_error_pickles() -> None:
    error = KVCacheTooLargeError(4096, "needs 9 GiB, the machine has 8 GiB")
    copy = round_trip(error)
    assert (copy.num_blocks, copy.detail, str(copy)) == (error.num_blocks, error.detail, str(error))


def test_plans_and_reports_pickle_with_every_field() -> None:
    records = (SlotRecord(b"k" * 16, 16, b"tag"), SlotRecord(b"j" * 16, 16))
    store = TransferJob(1, Tier.GPU, Tier.DISK, (3, 4), (0, 1), records)
    load = TransferJob(2, Tier.DISK, Tier.GPU, (0, 1, 5), (8, 9, 10), load_parts=(2, 1))
    plan = TransferPlan(7, (store, load), {2: ("a", "b")}, need_flush=True, end_persistence=True)
    assert round_trip(plan) == plan
    assert round_trip(load).load_parts == (2, 1)
    report = WorkerReport(
        done={1: 2}, failed={2: 2}, seconds={1: 0.5}, bad_blocks={2: frozenset({1, 5})}
    )
    merged = WorkerReport.merge([report, report])
    assert round_trip(report) == report
    assert round_trip(merged) == merged
    assert round_trip(merged).bad_blocks == {2: frozenset({1, 5})}
