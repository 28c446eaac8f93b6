"""`LoadTracker(block_level=True)`: named bad blocks become vLLM load errors (no vLLM).

A request whose every failed event named its bad source blocks is finished, and the GPU
blocks those were copied into are its load errors, returned in the same call's
aftermath (`take_invalid_blocks`), never before the request is finished; any failure
naming nothing fails it whole (`failed_recving`). `block_level_failures` says which vLLM
layouts take load errors by block.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.adapters.vllm.layout import block_level_failures
from kvtier.adapters.vllm.load_tracker import LoadTracker
from kvtier.offload.plan import Tier, TransferJob


def load(event_id: int, parts: tuple[int, ...], first: int = 10, dst: int = 100) -> TransferJob:
    """A disk load: sources `first`..., destinations `dst`..., in request order."""
    src = tuple(range(first, first + sum(parts)))
    dsts = tuple(range(dst, dst + sum(parts)))
    return TransferJob(event_id, Tier.DISK, Tier.GPU, src, dsts, load_parts=parts)


def test_readers_of_named_blocks_finish_with_their_destinations_as_errors() -> None:
    tracker = LoadTracker(block_level=True)
    tracker.update({1: ("r", "s", "t")}, [load(1, (2, 3, 1))])  # r: 10-11, s: 12-14, t: 15
    assert tracker.complete([], [1], {1: frozenset({13, 15})}) == ({"r", "s", "t"}, set())
    assert tracker.take_invalid_blocks() == {103, 105}
    assert tracker.take_invalid_blocks() == set()
    assert tracker.is_idle()


def test_a_block_two_requests_read_is_an_error_of_both() -> None:
    job = TransferJob(1, Tier.DISK, Tier.GPU, (7, 8, 7), (20, 21, 30), load_parts=(2, 1))
    tracker = LoadTracker(block_level=True)
    tracker.update({1: ("r", "s")}, [job])
    assert tracker.complete([], [1], {1: frozenset({7})}) == ({"r", "s"}, set())
    assert tracker.take_invalid_blocks() == {20, 30}


@pytest.mark.parametrize("whole_first", [False, True])
def test_a_failure_naming_nothing_fails_the_request_whole(whole_first: bool) -> None:
    """r reads events 1 (its blocks named) and 2 (failed naming nothing), either first."""
    tracker = LoadTracker(block_level=True)
    tracker.update({1: ("r",), 2: ("r",)}, [load(1, (2,)), load(2, (2,), first=20, dst=200)])
    named: dict[int, frozenset[int]] = {1: frozenset({11})}
    order = ([2], [1]) if whole_first else ([1], [2])
    assert tracker.complete([], order[0], named) == (set(), set())
    assert tracker.complete([], order[1], named) == ({"r"}, {"r"})
    assert tracker.take_invalid_blocks() == set()
    assert tracker.is_idle()


def test_errors_wait_for_the_requests_other_events_and_add_up() -> None:
    """r loads from CPU (event 1, done later) and disk (events 2 and 3, both named)."""
    tracker = LoadTracker(block_level=True)
    cpu = TransferJob(1, Tier.CPU, Tier.GPU, (3,), (50,), load_parts=(1,))
    jobs = [cpu, load(2, (1, 2)), load(3, (1,), first=30, dst=300)]  # s: 10, r: 11-12
    tracker.update({1: ("r",), 2: ("s", "r"), 3: ("r",)}, jobs)
    named = {2: frozenset({12}), 3: frozenset({30})}
    assert tracker.complete([], [2, 3], named) == ({"s"}, set())
    assert tracker.take_invalid_blocks() == set()  # r is not finished yet
    assert tracker.complete([1], []) == ({"r"}, set())
    assert tracker.take_invalid_blocks() == {102, 300}
    assert tracker.is_idle()


@pytest.mark.parametrize(
    "named", [frozenset(), frozenset({99}), frozenset({10, 99})], ids=["none", "foreign", "mixed"]
)
def test_names_that_are_not_source_blocks_fail_every_request_whole(
    named: frozenset[int],
) -> None:
    tracker = LoadTracker(block_level=True)
    tracker.update({1: ("r", "s")}, [load(1, (2, 2))])
    assert tracker.complete([], [1], {1: named}) == ({"r", "s"}, {"r", "s"})
    assert tracker.take_invalid_blocks() == set()
    assert tracker.is_idle()


def test_without_parts_every_request_fails_whole() -> None:
    tracker = LoadTracker(block_level=True)
    tracker.update({1: ("r", "s")}, [load(1, ())])
    assert tracker.complete([], [1], {1: frozenset({10})}) == ({"r", "s"}, {"r", "s"})
    assert tracker.take_invalid_blocks() == set()


def test_off_a_named_failure_fails_its_readers_whole() -> None:
    tracker = LoadTracker()
    tracker.update({1: ("r", "s")}, [load(1, (2, 2))])
    assert tracker.complete([], [1], {1: frozenset({12})}) == ({"r", "s"}, {"s"})
    assert tracker.take_invalid_blocks() == set()
    assert tracker.is_idle()


class FullAttentionSpec:  # `group_kind` goes by the spec's class name
    attention_chunk_size = None


class SlidingWindowSpec:
    pass


def config(*specs: Any) -> Any:
    class Group:
        def __init__(self, spec: Any) -> None:
            self.kv_cache_spec = spec

    class Config:
        def __init__(self) -> None:
            self.kv_cache_groups = [Group(spec) for spec in specs]

    return Config()


def test_only_one_full_attention_group_takes_errors_by_block() -> None:
    assert block_level_failures(config(FullAttentionSpec()))
    assert not block_level_failures(config(FullAttentionSpec(), FullAttentionSpec()))
    assert not block_level_failures(config(FullAttentionSpec(), SlidingWindowSpec()))
    assert not block_level_failures(config(SlidingWindowSpec()))
