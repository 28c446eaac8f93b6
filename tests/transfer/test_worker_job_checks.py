"""Job and registration checks of the worker: clear ValueErrors instead of coercion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transfer_helpers import fill_random, kv_per_layer, make_worker, run_plan

from kvtier.offload.plan import Tier, TransferJob, TransferPlan
from kvtier.transfer import OffloadWorker, WorkerConfig, WorkerState

pytestmark = pytest.mark.timeout(60)


def submit_one(bad: TransferJob) -> None:
    """Submit `bad` after a valid job in one plan; nothing of the plan may run."""
    kv = kv_per_layer(1, 16)
    fill_random(kv, seed=1)
    with make_worker(WorkerConfig(cpu_num_slots=8), kv) as worker:
        good = TransferJob(2, Tier.GPU, Tier.CPU, (1,), (1,))
        try:
            worker.submit(TransferPlan(1, jobs=(good, bad)))
        finally:
            worker.flush()
            assert worker.poll().is_empty
            worker.check_invariants()


def unchecked_job(src_tier: Tier, dst_tier: Tier, src: object, dst: object) -> TransferJob:
    """Return event 7 as a pickled job may arrive: `__post_init__`'s checks skipped."""
    bad = TransferJob.__new__(TransferJob)
    for name, value in zip(
        ("event_id", "src_tier", "dst_tier", "src_block_ids", "dst_block_ids", "dst_records"),
        (7, src_tier, dst_tier, src, dst, ()),
        strict=True,
    ):
        object.__setattr__(bad, name, value)
    return bad


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ((1.7,), (2,), r"event 7: GPU ids hold 1\.7 \(float\), not an int"),
        ((1,), (2.9,), r"event 7: CPU ids hold 2\.9 \(float\), not an int"),
        (("3",), (1,), r"event 7: GPU ids hold '3' \(str\)"),
        ((True,), (1,), r"event 7: GPU ids hold True \(bool\)"),
        ((1,), (np.bool_(False),), r"event 7: CPU ids hold .*False_? \(bool_?\)"),
        (((1, 2),), (0,), r"event 7: GPU ids hold \(1, 2\) \(tuple\)"),
        ((2**70,), (0,), r"event 7: GPU ids \[1180591620717411303424\] outside \[0, 16\)"),
        ((-(2**70),), (0,), r"event 7: GPU ids \[-1180591620717411303424\] outside"),
        ((np.uint64(2**64 - 1),), (0,), r"event 7: GPU ids \[18446744073709551615\] outside"),
        ((1,), (np.uint64(8),), r"event 7: CPU ids \[8\] outside \[0, 8\)"),
        (np.array([1.0]), (0,), r"event 7: GPU ids must be a 1-D integer array, got float64"),
        (np.array([2**64 - 1], dtype=np.uint64), (0,), r"GPU ids \[18446744073709551615\]"),
        (np.array([1]), np.array([-1]), r"event 7: CPU ids \[-1\] outside \[0, 8\)"),
        (3, 4, r"event 7: GPU ids must be a tuple of ints, got int"),
        # s33 mutation run (job_checks.py): each passed every older case.
        (np.array([[1], [2]]), (0, 1), r"GPU ids must be a 1-D integer array, got int64 of"),
        (np.array([True, False]), (0, 1), r"GPU ids must be a 1-D integer array, got bool"),
        ((1, 2**70, 3), (0, 1, 2), r"GPU ids \[1180591620717411303424\] outside \[0, 16\)"),
        (
            (*range(16), 0, 1),
            tuple(range(18)),
            r"CPU ids \[8, 9, 10, 11, 12, 13, 14, 15\] outside",
        ),
    ],
)
def test_block_ids_must_be_ints_in_range(src: object, dst: object, message: str) -> None:
    """Regression: 1.7 / "3" / True were coerced (1.7 copied block 1) and reported done;
    2**70 and uint64 max raised a bare OverflowError without the event id."""
    with pytest.raises(ValueError, match=message):
        submit_one(unchecked_job(Tier.GPU, Tier.CPU, src, dst))


@pytest.mark.parametrize(
    ("dst", "message"),
    [
        ((3, 3), r"event 7: repeated destination ids \[3\]$"),
        ((1, 4, 1, 1, 2), r"event 7: repeated destination ids \[1\]$"),
        ((0, 1, 2, 3, 4, 5, 6, 7) * 2, r"repeated destination ids \[0, 1, 2, 3, 4, 5, 6, 7\]$"),
    ],
)
def test_a_pickled_job_with_repeated_destinations_is_refused(
    dst: tuple[int, ...], message: str
) -> None:
    """A job that skipped `TransferJob.__post_init__` (pickled) and copies two blocks
    into one destination is refused, naming each repeated id once (s33 mutants: repeats
    looked for two apart went unseen; each repeat was listed as often as it repeated)."""
    src = tuple(i % 8 for i in range(len(dst)))  # CPU slots may repeat
    with pytest.raises(ValueError, match=message):
        submit_one(unchecked_job(Tier.CPU, Tier.GPU, src, dst))


@pytest.mark.parametrize(
    ("src", "dst", "records", "message"),
    [
        ((1, 2, 3), (1, 2), (), r"event 7: 3 source blocks but 2 destination blocks"),
        ((1,), (1, 2), (), r"event 7: 1 source blocks but 2 destination blocks"),
        ((1, 2), (1, 2), ("r",), r"event 7: 1 slot records for 2 destination blocks"),
        ((1,), (1,), None, r"event 7: dst_records must be a tuple, got NoneType"),
    ],
)
def test_a_pickled_job_with_mismatched_counts_is_refused(
    src: tuple[int, ...], dst: tuple[int, ...], records: object, message: str
) -> None:
    """Regression: a job that skipped `__post_init__` (unpickled, as vLLM's metadata is)
    with 3 source and 2 destination blocks copied 2 and was reported done."""
    bad = TransferJob(7, Tier.GPU, Tier.CPU, (0,), (0,))
    object.__setattr__(bad, "src_block_ids", src)
    object.__setattr__(bad, "dst_block_ids", dst)
    object.__setattr__(bad, "dst_records", records)
    with pytest.raises(ValueError, match=message):
        submit_one(bad)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((3, "GPU", Tier.CPU), r"event 3: src_tier must be a Tier, got 'GPU'"),
        ((3, Tier.GPU, "CPU"), r"event 3: dst_tier must be a Tier, got 'CPU'"),
        (("3", Tier.GPU, Tier.CPU), r"event_id must be an int, got '3'"),
        ((True, Tier.GPU, Tier.CPU), r"event_id must be an int, got True"),
    ],
)
def test_job_fields_of_the_wrong_type_are_named(fields: tuple[object, ...], message: str) -> None:
    """Regression: a tier given as a string raised AttributeError ('str' has no 'value')."""
    bad = TransferJob(*fields, (1,), (0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        submit_one(bad)


def test_numpy_integer_ids_are_accepted() -> None:
    """numpy integers (scalars in a tuple, or an integer array) are valid block ids.

    The load runs in a plan of its own: stores and loads run on two lanes, concurrently,
    so a load in the store's plan could read the slots before they are written (a
    scheduler only loads a slot once its store was reported)."""
    kv = kv_per_layer(1, 16)
    fill_random(kv, seed=2)
    with make_worker(WorkerConfig(cpu_num_slots=8), kv) as worker:
        store = TransferJob(1, Tier.GPU, Tier.CPU, (np.int64(3), np.int32(4)), (np.uint8(0), 1))
        load = TransferJob(2, Tier.CPU, Tier.GPU, np.array([0, 1]), np.array([5, 6], np.uint16))
        assert dict(run_plan(worker, store).done) == {1: 1}
        assert dict(run_plan(worker, load).done) == {2: 1}
        views = worker.regions.block_views()
        assert all(torch.equal(v[3], v[5]) and torch.equal(v[4], v[6]) for v in views)


def test_unallocatable_host_tier_names_the_slots_and_bytes() -> None:
    """Regression: a too large cpu_num_slots gave a raw DefaultCPUAllocator error. 2**41
    slots of 1 KiB exceed any address space, so the allocation fails at once."""
    worker = OffloadWorker(WorkerConfig(cpu_num_slots=2**41))
    kv = [torch.zeros(4, 1024, dtype=torch.uint8)]
    with pytest.raises(MemoryError, match=r"cpu_num_slots=2199023255552 .* 1024 B per slot"):
        worker.register(kv)
    assert worker.state is WorkerState.CREATED
    assert worker.host_tier is None
    worker.check_invariants()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"forget_slots": 5}, r"TransferPlan\.forget_slots must be a tuple of slot ids, got 5"),
        ({"forget_slots": "12"}, r"TransferPlan\.forget_slots must be a tuple .*got '12'"),
        ({"need_flush": "no"}, r"TransferPlan\.need_flush must be a bool, got 'no'"),
        ({"end_persistence": 1}, r"TransferPlan\.end_persistence must be a bool, got 1"),
    ],
)
def test_plan_fields_of_the_wrong_type_are_named(fields: dict[str, object], message: str) -> None:
    """Regression: a pickled plan's `forget_slots` of 5 raised TypeError ('int' object is
    not iterable) on a worker with a disk tier, a str was taken character by character,
    and on a worker without one both were ignored; need_flush='no' flushed. Nothing of
    the plan runs."""
    kv = kv_per_layer(1, 16)
    with make_worker(WorkerConfig(cpu_num_slots=8), kv) as worker:
        good = TransferJob(2, Tier.GPU, Tier.CPU, (1,), (1,))
        plan = TransferPlan(1, jobs=(good,))
        for name, value in fields.items():
            object.__setattr__(plan, name, value)
        with pytest.raises(ValueError, match=message):
            worker.submit(plan)
        worker.flush()
        assert worker.poll().is_empty
        worker.check_invariants()
