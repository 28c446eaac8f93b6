"""The plan's records (`kvtier.offload.plan`): what a `TransferJob` refuses when it is
built, which jobs are stores and loads, when a plan or a report is empty, and how
reports of several workers merge (SPEC §6.4, §6.8)."""

from __future__ import annotations

import pytest

from kvtier.core.keys import make_key
from kvtier.offload.plan import SlotRecord, Tier, TransferJob, TransferPlan, WorkerReport


@pytest.mark.parametrize(
    ("src", "dst", "records", "message"),
    [
        ((1, 2, 3), (4, 5), 0, r"event 7: 3 source blocks but 2 destination blocks"),
        ((1, 2), (4, 5), 1, r"event 7: 1 slot records for 2 destination blocks"),
    ],
    ids=["blocks", "records"],
)
def test_a_job_whose_lists_do_not_pair_up_is_refused(
    src: tuple[int, ...], dst: tuple[int, ...], records: int, message: str
) -> None:
    """`src_block_ids[i]` is copied to `dst_block_ids[i]`: a job whose lists differ in
    length would copy some block to no place, or record a slot it never wrote."""
    slot_records = tuple(SlotRecord(make_key(b"k" * 32, 0), 4) for _ in range(records))
    with pytest.raises(ValueError, match=message):
        TransferJob(7, Tier.GPU, Tier.DISK, src, dst, slot_records)


def test_a_job_within_one_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="event 7: source and destination tier are both CPU"):
        TransferJob(7, Tier.CPU, Tier.CPU, (1,), (2,))


def test_load_parts_that_are_not_a_tuple_are_refused() -> None:
    with pytest.raises(ValueError, match=r"event 7: load parts \[2\] are not a tuple"):
        TransferJob(7, Tier.CPU, Tier.GPU, (1, 2), (3, 4), load_parts=[2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("src", "dst", "is_store", "is_load"),
    [
        (Tier.GPU, Tier.CPU, True, False),
        (Tier.GPU, Tier.DISK, True, False),
        (Tier.CPU, Tier.GPU, False, True),
        (Tier.DISK, Tier.GPU, False, True),
        (Tier.CPU, Tier.DISK, False, False),  # a cascade's demotion
    ],
)
def test_a_demotion_is_neither_a_store_nor_a_load(
    src: Tier, dst: Tier, is_store: bool, is_load: bool
) -> None:
    """A store copies from the GPU, a load into it; a CPU → disk move does neither (a
    worker that took it for a load would report its blocks as a request's)."""
    job = TransferJob(1, src, dst, (1, 2), (3, 4))
    assert (job.is_store, job.is_load, job.num_blocks) == (is_store, is_load, 2)


@pytest.mark.parametrize(
    "fields",
    [
        {"jobs": (TransferJob(1, Tier.GPU, Tier.CPU, (1,), (2,)),)},
        {"need_flush": True},
        {"end_persistence": True},
        {"forget_slots": (3,)},
    ],
    ids=["jobs", "need_flush", "end_persistence", "forget_slots"],
)
def test_a_plan_with_anything_to_do_is_not_empty(fields: dict[str, object]) -> None:
    assert TransferPlan(1).is_empty
    assert not TransferPlan(1, **fields).is_empty  # type: ignore[arg-type]


def test_a_report_of_a_failure_only_is_not_empty() -> None:
    assert WorkerReport().is_empty
    assert not WorkerReport(failed={4: 1}).is_empty
    assert not WorkerReport(done={4: 1}).is_empty


def test_merged_reports_keep_the_slowest_time_whatever_their_order() -> None:
    slow, fast = (
        WorkerReport(done={1: 1}, seconds={1: 0.7}),
        WorkerReport(done={1: 1}, seconds={1: 0.3}),
    )
    assert WorkerReport.merge([slow, fast]).seconds == {1: 0.7}
    assert WorkerReport.merge([fast, slow]).seconds == {1: 0.7}


def test_a_report_of_no_failure_of_an_event_keeps_its_named_bad_blocks() -> None:
    """Only a report that *failed* the event without naming blocks makes every block of
    it suspect; one that lists it with a count of 0 failed nothing."""
    named = WorkerReport(failed={4: 1}, bad_blocks={4: frozenset({9})})
    merged = WorkerReport.merge([named, WorkerReport(done={4: 1}, failed={4: 0})])
    assert merged.failed == {4: 1}
    assert merged.bad_blocks == {4: frozenset({9})}
