"""`LoadTracker`: a request split over several load events (pure Python, no vLLM)."""

from __future__ import annotations

import pytest

from kvtier.adapters.vllm.load_tracker import LoadTracker

NOTHING: tuple[set[str], set[str]] = (set(), set())


def test_a_request_split_over_two_events_finishes_after_both() -> None:
    tracker = LoadTracker()
    tracker.update({1: ("r", "s"), 2: ("r",)})  # r: CPU part (1) and DISK part (2)
    assert tracker.complete([1], []) == ({"s"}, set())
    assert tracker.complete([7], []) == NOTHING  # a store: not a load event
    # The scheduler still lists event 1 until every rank reported it: not pending again.
    tracker.update({1: ("r", "s"), 2: ("r",)})
    assert tracker.complete([], []) == NOTHING
    assert tracker.complete([2], []) == ({"r"}, set())
    assert tracker.is_idle()
    tracker.update({})
    assert tracker.complete([1, 2], []) == NOTHING  # reported twice: ignored


def test_both_parts_finishing_in_one_poll_report_once() -> None:
    tracker = LoadTracker()
    tracker.update({3: ("r",), 4: ("r",)})
    assert tracker.complete([4, 3], []) == ({"r"}, set())
    tracker.update({3: ("r",)})  # another rank has not reported 3 yet
    assert tracker.complete([3], []) == NOTHING
    assert tracker.is_idle()


def test_a_failed_part_fails_the_request_once_both_parts_finished() -> None:
    tracker = LoadTracker()
    tracker.update({1: ("r",), 2: ("r",)})
    # The other part still writes r's blocks: vLLM must not recompute into them yet.
    assert tracker.complete([], [2]) == NOTHING
    tracker.update({1: ("r",), 2: ("r",)})
    assert tracker.complete([1], []) == ({"r"}, {"r"})
    assert tracker.is_idle()


@pytest.mark.parametrize(
    ("done", "failed", "failed_requests"),
    [([2], [1], {"r", "s"}), ([1], [2], {"r"}), ([], [1, 2], {"r", "s"})],
)
def test_either_part_or_both_failing_fails_the_request(
    done: list[int], failed: list[int], failed_requests: set[str]
) -> None:
    tracker = LoadTracker()
    tracker.update({1: ("r", "s"), 2: ("r",)})
    assert tracker.complete(done, failed) == ({"r", "s"}, failed_requests)
    assert tracker.is_idle()
    assert len(tracker) == 0


def test_events_the_scheduler_stops_listing_are_forgotten() -> None:
    """An event stays remembered only while listed: a long-lived server must not keep
    every load event id it ever finished."""
    tracker = LoadTracker()
    tracker.update({1: ("r",), 2: ("s",)})
    assert tracker.complete([1], [2]) == ({"r", "s"}, {"s"})
    tracker.update({2: ("s",)})  # another rank has not reported event 2 yet
    assert tracker.complete([2], []) == NOTHING
    tracker.update({})
    assert not tracker._finished  # nothing kept for an event no longer listed
