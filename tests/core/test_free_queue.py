"""Tests for kvtier.core.free_queue (SPEC §4, free queue)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.core.free_queue import LRUFreeQueue


def make_queue(num_blocks: int = 8, fill: range | None = None) -> LRUFreeQueue:
    queue = LRUFreeQueue(num_blocks)
    if fill is not None:
        queue.clear_and_fill(fill)
    return queue


def queued(queue: LRUFreeQueue) -> list[int]:
    return list(queue.iter_after(None))


def test_new_queue_is_empty_and_pop_raises() -> None:
    """A fresh queue holds nothing and refuses to pop a victim."""
    queue = make_queue()
    assert len(queue) == 0
    assert queued(queue) == []
    with pytest.raises(IndexError):
        queue.pop_victim()


def test_clear_and_fill_holds_exactly_the_range_in_order() -> None:
    """`clear_and_fill` replaces the content with the range, head first."""
    queue = make_queue(fill=range(1, 8))
    assert queued(queue) == [1, 2, 3, 4, 5, 6, 7]
    queue.clear_and_fill(range(3, 5))
    assert queued(queue) == [3, 4]
    assert len(queue) == 2


def test_push_cached_appends_at_the_tail() -> None:
    """Cached blocks join at the most-recently-used end, in push order."""
    queue = make_queue()
    for block_id in (5, 2, 7):
        queue.push_cached(block_id)
    assert queued(queue) == [5, 2, 7]


def test_push_reusable_goes_to_the_head() -> None:
    """An unhashed block is placed before every queued block (the latest one first)."""
    queue = make_queue(fill=range(1, 3))
    queue.push_reusable(6)
    queue.push_reusable(5)
    assert queued(queue) == [5, 6, 1, 2]
    assert queue.pop_victim() == 5


@pytest.mark.parametrize(
    "take_out", [LRUFreeQueue.remove, LRUFreeQueue.discard], ids=lambda f: f.__name__
)
@pytest.mark.parametrize("victim", [1, 3, 5])
def test_remove_and_discard_unlink_head_middle_or_tail(
    victim: int, take_out: Callable[[LRUFreeQueue, int], None]
) -> None:
    """`remove` and `discard` take one block out wherever it sits, keeping the rest in order."""
    queue = make_queue(fill=range(1, 6))
    take_out(queue, victim)
    assert queued(queue) == [b for b in range(1, 6) if b != victim]
    assert len(queue) == 4


def test_pop_victim_returns_blocks_head_first_until_empty() -> None:
    """Victims come out in queue order; the emptied queue raises."""
    queue = make_queue(fill=range(1, 4))
    assert [queue.pop_victim() for _ in range(3)] == [1, 2, 3]
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.pop_victim()


def test_iter_after_starts_after_the_cursor() -> None:
    """`iter_after(cursor)` yields only the blocks behind the cursor; none after the tail."""
    queue = make_queue(fill=range(1, 6))
    assert list(queue.iter_after(2)) == [3, 4, 5]
    assert list(queue.iter_after(5)) == []


def test_pop_victims_refuses_more_than_queued() -> None:
    """Popping a run longer than the queue raises and leaves the queue as it was."""
    queue = make_queue(fill=range(1, 4))
    with pytest.raises(IndexError, match="cannot pop 4 blocks from a queue of 3"):
        queue.pop_victims(4)
    assert queued(queue) == [1, 2, 3]


def test_removed_block_can_be_pushed_again() -> None:
    """A block taken out and pushed back appears exactly once, at its new place."""
    queue = make_queue(fill=range(1, 5))
    queue.remove(2)
    queue.push_cached(2)
    assert queued(queue) == [1, 3, 4, 2]
    assert len(queue) == 4


@pytest.mark.parametrize(
    ("length_error", "message"), [(1, "shorter than its length"), (-1, "longer than its length")]
)
def test_check_invariants_catches_a_wrong_length(length_error: int, message: str) -> None:
    """A length that disagrees with the links fails the queue's own check.

    LRUFreeQueue had no check_invariants (the pool looked it up with getattr and skipped
    it); it is now part of the FreeQueue protocol.
    """
    queue = make_queue(fill=range(1, 6))
    queue.check_invariants()
    queue._len += length_error
    with pytest.raises(AssertionError, match=message):
        queue.check_invariants()


def test_check_invariants_catches_a_tail_link_to_a_block_before_the_last() -> None:
    """`push_cached` appends after the sentinel's back link: one naming block 3 of
    [1..5] would link a freed block after 3 and cut 4 and 5 off (found by a mutation
    run: the check could be dropped with every test passing)."""
    queue = make_queue(fill=range(1, 6))
    queue._prev[queue.num_blocks] = 3
    with pytest.raises(AssertionError, match="the tail link is not the last block"):
        queue.check_invariants()


def test_check_invariants_stops_at_a_cycle() -> None:
    """A link pointing back into the queue fails the check instead of looping forever."""
    queue = make_queue(fill=range(1, 6))
    queue._next[3] = 2
    with pytest.raises(AssertionError, match="block 2 queued twice"):
        queue.check_invariants()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["reusable", "cached", "remove", "pop", "pop_many", "cached_many"]),
        st.integers(1, 9),
    ),
    max_size=40,
)


@settings(max_examples=scaled_examples(200), deadline=None)
@given(ops=OPS)
def test_matches_a_list_model(ops: list[tuple[str, int]]) -> None:
    """Random pushes, removals and pops leave the same order as a plain list."""
    queue = make_queue(num_blocks=10)
    model: list[int] = []
    for op, block_id in ops:
        if op == "pop":
            if model:
                assert queue.pop_victim() == model.pop(0)
        elif op == "pop_many":
            count = min(block_id % 4, len(model))
            assert queue.pop_victims(count) == model[:count]
            del model[:count]
        elif op == "cached_many":
            run = [b for b in range(block_id, 10) if b not in model][:3]
            queue.push_cached_many(run)
            model.extend(run)
        elif op == "remove":
            if block_id in model:
                queue.remove(block_id)
                model.remove(block_id)
        elif block_id not in model:
            if op == "reusable":
                queue.push_reusable(block_id)
                model.insert(0, block_id)
            else:
                queue.push_cached(block_id)
                model.append(block_id)
        assert queued(queue) == model
        assert len(queue) == len(model)
        queue.check_invariants()
