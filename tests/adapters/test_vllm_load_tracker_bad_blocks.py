"""`LoadTracker` with named bad blocks: only the requests reading one fail (no vLLM)."""

from __future__ import annotations

import logging

import pytest

from kvtier.adapters.vllm.load_tracker import LoadTracker
from kvtier.offload.plan import Tier, TransferJob


def load(event_id: int, parts: tuple[int, ...], first: int = 10) -> TransferJob:
    src = tuple(range(first, first + sum(parts)))
    dst = tuple(range(100, 100 + sum(parts)))
    return TransferJob(event_id, Tier.DISK, Tier.GPU, src, dst, load_parts=parts)


def test_only_the_requests_reading_a_bad_block_fail() -> None:
    tracker = LoadTracker()
    tracker.update({1: ("r", "s", "t")}, [load(1, (2, 3, 1))])  # r: 10-11, s: 12-14, t: 15
    outcome = tracker.complete([], [1], {1: frozenset({13, 15})})
    assert outcome == ({"r", "s", "t"}, {"s", "t"})
    assert tracker.is_idle()


@pytest.mark.parametrize(
    "named", [frozenset(), frozenset({99}), frozenset({10, 99})], ids=["none", "foreign", "mixed"]
)
def test_names_that_are_not_source_blocks_fail_every_request(named: frozenset[int]) -> None:
    tracker = LoadTracker()
    tracker.update({1: ("r", "s")}, [load(1, (2, 2))])
    assert tracker.complete([], [1], {1: named}) == ({"r", "s"}, {"r", "s"})
    assert tracker.is_idle()


def test_without_names_or_parts_every_request_fails() -> None:
    tracker = LoadTracker()
    tracker.update({1: ("r", "s"), 2: ("u", "v")}, [load(1, (2, 2)), load(2, (), first=20)])
    outcome = tracker.complete([], [1, 2], {2: frozenset({20})})
    assert outcome == ({"r", "s", "u", "v"}, {"r", "s", "u", "v"})
    assert tracker.is_idle()


def test_a_request_whose_other_part_is_bad_fails_once_both_finished() -> None:
    """r loads from CPU (event 1) and disk (event 2); only disk's bad block is r's."""
    tracker = LoadTracker()
    cpu = TransferJob(1, Tier.CPU, Tier.GPU, (3,), (50,), load_parts=(1,))
    tracker.update({1: ("r",), 2: ("s", "r")}, [cpu, load(2, (1, 1))])  # s: 10, r: 11
    assert tracker.complete([], [2], {2: frozenset({11})}) == ({"s"}, set())
    assert tracker.complete([1], []) == ({"r"}, {"r"})
    assert tracker.is_idle()


def test_parts_are_forgotten_once_the_event_is_no_longer_listed() -> None:
    tracker = LoadTracker()
    tracker.update({1: ("r",)}, [load(1, (1,))])
    tracker.update({})  # e.g. a reset: the scheduler stopped listing it
    assert not tracker._parts  # nothing kept for an event no longer listed


def test_a_load_job_whose_parts_do_not_add_up_is_refused() -> None:
    with pytest.raises(ValueError, match="do not add up"):
        TransferJob(1, Tier.DISK, Tier.GPU, (1, 2), (3, 4), load_parts=(1,))


def test_parts_that_only_add_up_fail_every_request_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job unpickled on a worker skipped its own checks. Parts (3, -1) of two blocks
    would give r both blocks and s none, so s, reading bad block 11, would finish."""
    job = load(1, (1, 1))
    object.__setattr__(job, "load_parts", (3, -1))  # as if it came so by pickle
    tracker = LoadTracker()
    with caplog.at_level(logging.WARNING, logger="kvtier.adapters.vllm.load_tracker"):
        tracker.update({1: ("r", "s")}, [job])
    assert tracker.complete([], [1], {1: frozenset({11})}) == ({"r", "s"}, {"r", "s"})
    assert "load part 1 of (3, -1) is -1" in caplog.text
    assert tracker.is_idle()


def test_unsplit_lists_the_named_failures_of_the_last_call_failed_whole() -> None:
    """The worker strips the names of those from its report (the scheduler fails them
    whole too); an event split by its names, or failed naming nothing, is not listed,
    and each call starts afresh."""
    tracker = LoadTracker()
    jobs = [load(1, (1, 1)), load(2, (1, 1)), load(3, ()), load(4, (1,), first=40)]
    tracker.update({1: ("r", "s"), 2: ("t", "u"), 3: ("v",), 4: ("w",)}, jobs)
    named = {1: frozenset({11}), 2: frozenset({99}), 3: frozenset({10})}
    assert tracker.complete([], [1, 2, 3, 4], named)[1] == {"s", "t", "u", "v", "w"}
    assert tracker.unsplit == {2, 3}  # 2: a name not its source; 3: parts unknown
    tracker.update({})
    assert tracker.complete([], []) == (set(), set())
    assert tracker.unsplit == set()


def test_a_load_job_of_an_event_the_plan_does_not_list_keeps_no_parts() -> None:
    """A job that came by pickle skipped the plan's own check that its event is listed:
    its parts are not kept, not even until the next plan (no leak: `is_idle`)."""
    tracker = LoadTracker()
    tracker.update({}, [load(1, (1,))])
    assert not tracker._parts
    assert tracker.is_idle()
