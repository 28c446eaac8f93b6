"""vLLM's failed requests (the union over ranks of each `LoadTracker`'s) are exactly the
loads the scheduler fails from the ranks' reports, however those arrive (no vLLM).

Each rank finishes one load event as done, failed naming bad blocks, or failed naming
nothing; the scheduler gets the reports in any order, merged in any grouping, over one
or more steps. Several requests may read the same block; a rank may name a block the
event did not read (99). A request neither side fails read no block a rank named, on no
rank that failed without names (never wrong KV).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.adapters.vllm.load_tracker import LoadTracker
from kvtier.offload.plan import Tier, TransferJob, WorkerReport
from kvtier.offload.transfers import IssuedTransfer, LoadItem, LoadProgress, TransferBook

EVENT = 7


@st.composite
def scenarios(draw: Any) -> tuple[Any, ...]:
    """Return (blocks per request, each rank's outcome, arrival order, step cuts)."""
    num_requests = draw(st.integers(1, 4))
    parts = [draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)) for _ in range(num_requests)]
    src = [b for part in parts for b in part]
    outcomes = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["done", "named", "unnamed"]))
        named = frozenset(draw(st.lists(st.sampled_from([*src, 99]), min_size=1, max_size=3)))
        outcomes.append((kind, named))
    order = draw(st.permutations(range(len(outcomes))))
    cuts = draw(st.lists(st.booleans(), min_size=len(outcomes), max_size=len(outcomes)))
    return parts, outcomes, order, cuts


def rank_report(kind: str, named: frozenset[int]) -> WorkerReport:
    if kind == "done":
        return WorkerReport(done={EVENT: 1})
    if kind == "named":
        return WorkerReport(failed={EVENT: 1}, bad_blocks={EVENT: named})
    return WorkerReport(failed={EVENT: 1})


@settings(max_examples=scaled_examples(300), deadline=None)
@given(scenarios())
def test_the_ranks_fail_the_requests_the_scheduler_fails(scenario: tuple[Any, ...]) -> None:
    parts, outcomes, order, cuts = scenario
    src = tuple(b for part in parts for b in part)
    requests = tuple(f"r{i}" for i in range(len(parts)))
    job = TransferJob(
        EVENT,
        Tier.DISK,
        Tier.GPU,
        src,
        tuple(range(100, 100 + len(src))),
        load_parts=tuple(len(part) for part in parts),
    )
    reports = [rank_report(kind, named) for kind, named in outcomes]
    vllm_failed: set[str] = set()
    for report in reports:
        tracker = LoadTracker()
        tracker.update({EVENT: requests}, [job])
        finished, failed = tracker.complete(report.done, report.failed, report.bad_blocks)
        assert finished == set(requests)
        assert tracker.is_idle()
        vllm_failed |= failed
    book = TransferBook(len(outcomes))
    loads = [
        LoadItem(Tier.DISK, list(part), [0] * len(part), LoadProgress(request, 0, 1, 1))
        for request, part in zip(requests, parts, strict=True)
    ]
    book.issue(IssuedTransfer(job, loads=loads))
    steps: list[list[WorkerReport]] = [[]]
    for rank, cut in zip(order, cuts, strict=True):
        steps[-1].append(reports[rank])
        if cut:
            steps.append([])
    completed = [t for step in steps if step for t in book.complete(WorkerReport.merge(step))]
    (transfer,) = completed
    failed_loads = {
        load.request_id for load in transfer.loads if transfer.suspect(load.tier_block_ids)
    }
    assert failed_loads == vllm_failed
    for load in transfer.loads:
        if load.request_id not in failed_loads:
            for kind, named in outcomes:
                assert kind != "unnamed"
                assert kind == "done" or not set(load.tier_block_ids) & named


def merge_key(report: WorkerReport) -> tuple[dict[int, int], dict[int, int], dict[int, Any]]:
    return dict(report.done), dict(report.failed), dict(report.bad_blocks)


reports_st = st.builds(
    lambda done, failed, named: WorkerReport(
        done=dict.fromkeys(done, 1),
        failed=failed,
        bad_blocks={e: frozenset(b) for e, b in named.items() if failed.get(e)},
    ),
    st.sets(st.integers(1, 3)),
    st.dictionaries(st.integers(1, 3), st.integers(0, 2)),
    st.dictionaries(st.integers(1, 3), st.sets(st.integers(0, 4), max_size=2)),
)


@settings(max_examples=scaled_examples(300), deadline=None)
@given(st.lists(reports_st, min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_merge_is_associative_and_commutative(reports: list[WorkerReport], rnd: Any) -> None:
    """vLLM aggregates the ranks' metadata pairwise, in any order and grouping."""
    shuffled = list(reports)
    rnd.shuffle(shuffled)
    cut = rnd.randint(0, len(shuffled))
    grouped = WorkerReport.merge(
        [WorkerReport.merge(shuffled[:cut]), WorkerReport.merge(shuffled[cut:])]
    )
    assert merge_key(WorkerReport.merge(reports)) == merge_key(grouped)
