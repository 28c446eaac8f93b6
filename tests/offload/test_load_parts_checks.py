"""`TransferJob.load_parts` is checked value by value (docs/load_failures.md).

The parts tell a worker which requests read a bad block; parts that only add up (a
negative or zero count beside a too large one) would hand a request's blocks to another
request, and a bad block would then fail the wrong one while its reader used bad KV.
"""

from __future__ import annotations

import pytest

from kvtier.offload.plan import Tier, TransferJob, TransferPlan
from kvtier.offload.transfers import IssuedTransfer, LoadItem, LoadProgress, TransferBook


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ((3, -1), r"load part 1 of \(3, -1\) is -1, not a block count"),
        ((2, 0), r"load part 1 of \(2, 0\) is 0, not a block count"),
        ((True, 1), r"load part 0 of \(True, 1\) is True, not a block count"),
        ((1.0, 1), r"load part 0 of \(1.0, 1\) is 1.0, not a block count"),
        ((1,), r"load parts \(1,\) do not add up to 2 source blocks"),
    ],
    ids=["negative", "zero", "bool", "float", "sum"],
)
def test_a_part_that_is_not_a_block_count_is_refused_by_name(
    parts: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TransferJob(1, Tier.DISK, Tier.GPU, (1, 2), (3, 4), load_parts=parts)


def test_parts_on_a_job_that_is_not_a_load_are_refused() -> None:
    with pytest.raises(ValueError, match=r"load parts \(2,\) on a GPU → DISK job, not a load"):
        TransferJob(1, Tier.GPU, Tier.DISK, (1, 2), (3, 4), load_parts=(2,))


def test_a_plan_needs_one_part_per_listed_request() -> None:
    job = TransferJob(4, Tier.CPU, Tier.GPU, (1, 2), (3, 4), load_parts=(1, 1))
    with pytest.raises(ValueError, match=r"event 4: 2 load parts \(1, 1\) for 1 requests"):
        TransferPlan(1, (job,), {4: ("a",)})
    with pytest.raises(ValueError, match="load_request_ids does not list the event"):
        TransferPlan(1, (job,), {})
    assert TransferPlan(1, (job,), {4: ("a", "b")}).jobs == (job,)


def test_the_book_refuses_parts_that_are_not_its_loads_block_counts() -> None:
    def item(request_id: str, blocks: list[int]) -> LoadItem:
        progress = LoadProgress(request_id, 0, 4 * len(blocks), 1)
        return LoadItem(Tier.CPU, blocks, [b + 100 for b in blocks], progress)

    loads = [item("a", [1]), item("b", [2, 3])]
    swapped = TransferJob(5, Tier.CPU, Tier.GPU, (1, 2, 3), (101, 102, 103), load_parts=(2, 1))
    with pytest.raises(ValueError, match=r"load parts \(2, 1\) are not the block counts \(1, 2\)"):
        TransferBook(1).issue(IssuedTransfer(swapped, loads=loads))
    reordered = TransferJob(6, Tier.CPU, Tier.GPU, (2, 3, 1), (102, 103, 101), load_parts=(1, 2))
    with pytest.raises(ValueError, match="source blocks are not its loads' tier blocks"):
        TransferBook(1).issue(IssuedTransfer(reordered, loads=loads))
    book = TransferBook(1)
    job = TransferJob(7, Tier.CPU, Tier.GPU, (1, 2, 3), (101, 102, 103), load_parts=(1, 2))
    book.issue(IssuedTransfer(job, loads=loads))
    assert book.load_request_ids() == {7: ("a", "b")}
