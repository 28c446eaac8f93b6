"""`belady` against the optimum: an exhaustive search over every content a one-tier cache
of C blocks can hold after each request (any C of the keys it held or the request
brought), scoring the tier's prefix hits in blocks (docs/policies.md, "Offline
references"). Without a tier in front, and behind a GPU tier with the scheduler's
release order, Belady's rule (evict the farthest next use, store nothing never reached
again) reaches that optimum."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st
from reference_model import BLOCK, RefTier, serve_on_gpu, traces

from example_counts import scaled_examples
from kvtier.replay.tier_replay import ReleaseOrder, ReplayConfig, TierConfig, replay_trace
from kvtier.replay.trace import TraceRecord


def optimum(ids: Sequence[tuple[int, ...]], starts: Sequence[int], capacity: int) -> int:
    """Return the most tier block hits any sequence of cache contents gets."""

    @cache
    def best(i: int, held: frozenset[int]) -> int:
        if i == len(ids):
            return 0
        end = starts[i]
        while end < len(ids[i]) and ids[i][end] in held:
            end += 1
        keys = sorted(held | set(ids[i]))
        after = max(
            best(i + 1, frozenset(kept))
            for size in range(min(capacity, len(keys)) + 1)
            for kept in itertools.combinations(keys, size)
        )
        return end - starts[i] + after

    return best(0, frozenset())


def small(records: list[TraceRecord]) -> bool:
    return len({h for r in records for h in r.hash_ids}) <= 8 and len(records) <= 8


@settings(max_examples=scaled_examples(400), deadline=None)
@given(traces().filter(small), st.integers(1, 3))
def test_belady_reaches_the_optimum_with_no_tier_in_front(
    records: list[TraceRecord], capacity: int
) -> None:
    config = ReplayConfig((TierConfig("CPU", capacity * BLOCK, 1.0),), "belady", 0, BLOCK)
    (cpu,) = replay_trace(records, config).tiers
    ids = [r.hash_ids for r in records]
    assert cpu.num_hit_blocks == optimum(ids, [0] * len(ids), capacity)


@settings(max_examples=scaled_examples(400), deadline=None)
@given(traces().filter(small), st.integers(1, 3), st.integers(0, 2))
def test_belady_reaches_the_optimum_behind_a_gpu_tier_with_the_scheduler_release(
    records: list[TraceRecord], capacity: int, extra_gpu_blocks: int
) -> None:
    """The references the GPU tier serves are not the tier's (`FutureOracle.reach_from`);
    loads are freed before the stores allocate, as the scheduler does."""
    gpu = max(len(r.hash_ids) for r in records) + extra_gpu_blocks
    front = RefTier(gpu)
    starts = [serve_on_gpu(front, r.hash_ids, [BLOCK] * len(r.hash_ids)) for r in records]
    config = ReplayConfig(
        (TierConfig("CPU", capacity * BLOCK, 1.0),),
        "belady",
        gpu * BLOCK,
        BLOCK,
        release_order=ReleaseOrder.SCHEDULER_TAIL_FIRST,
    )
    (cpu,) = replay_trace(records, config).tiers
    assert cpu.num_hit_blocks == optimum([r.hash_ids for r in records], starts, capacity)
