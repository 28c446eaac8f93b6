"""`belady` and `oracle-lfu` against brute force, behind a GPU tier and a CPU tier.

Each lower tier sees only the references the tiers in front do not serve
(docs/policies.md, "Tiers in front"); the brute force recomputes every rank from the
trace at each decision. test_tier_replay.py checks Belady alone on two fixed traces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference_model import BLOCK, RefTier, serve_on_gpu, traces

from example_counts import scaled_examples
from kvtier.replay.tier_replay import ReplayConfig, TierConfig, replay_trace
from kvtier.replay.trace import TraceRecord

NEVER = float("inf")
Rank = Callable[[int, int], float]  # (id, request) -> eviction rank, highest goes first


def brute_force(
    records: Sequence[TraceRecord], starts: Sequence[int], capacity: int, policy: str
) -> list[int]:
    """Replay one tier reached from `starts[i]` in request i; return where each request's
    hit ends. Store a key only if it is used again and ranks below the free key that
    would be evicted (the highest rank; ties: the one freed or referenced longest ago)."""
    refs = [(i, j, h) for i, r in enumerate(records) for j, h in enumerate(r.hash_ids)]

    def uses(h: int, i: int) -> list[int]:
        return [n for n, (k, j, g) in enumerate(refs) if k > i and g == h and j >= starts[k]]

    def rank(h: int, i: int) -> float:
        later = uses(h, i)
        return (later[0] if later else NEVER) if policy == "belady" else -len(later)

    cache: dict[int, tuple[float, int]] = {}  # id -> (rank, stamp) while free
    clock = iter(range(1 << 30))
    ends = []
    for i, r in enumerate(records):
        ids = r.hash_ids
        for h in ids:  # a reference reads the rank again
            if h in cache:
                cache[h] = (rank(h, i), next(clock))
        end = starts[i]
        while end < len(ids) and ids[end] in cache:
            end += 1
        ends.append(end)
        pinned = set(ids[starts[i] : end])
        stored = []
        for j in [j for j, h in enumerate(ids) if h not in cache]:
            if not uses(ids[j], i):
                continue
            if len(cache) >= capacity:
                free = [h for h in cache if h not in pinned]
                if not free:
                    break
                victim = max(free, key=lambda h: (cache[h][0], -cache[h][1]))
                if rank(ids[j], i) >= cache[victim][0]:
                    continue
                del cache[victim]
            cache[ids[j]] = (0, 0)
            pinned.add(ids[j])
            stored.append(j)
        for j in sorted([*range(starts[i], end), *stored], reverse=True):
            cache[ids[j]] = (rank(ids[j], i), next(clock))
    return ends


# A request references a block its tier holds behind a miss: ranked again then, or its rank
# points into the past (found by a mutation run; the random traces had not reached it).
RERANKED = [
    TraceRecord(t, n, 1, ids)
    for t, (n, ids) in enumerate(
        [
            (10, (0, 1, 2)),
            (17, (0, 1, 3, 4, 5)),
            (32, (0, 1, 3, 4, 6, 7, 8, 9)),
            (16, (10, 11, 12, 13)),
            (9, (14, 15, 16)),
            (22, (0, 1, 3, 17, 18, 19)),
            (11, (20, 21, 22)),
            (18, (0, 23, 24, 25, 26)),
            (15, (14, 15, 27, 28)),
            (19, (0, 23, 24, 29, 30)),
            (24, (0, 23, 24, 25, 31, 32)),
            (22, (0, 1, 3, 17, 33, 34)),
        ]
    )
]


@settings(max_examples=scaled_examples(500), deadline=None)
@example(records=RERANKED, gpu=0, caps=[2, 3], policy="oracle-lfu")
@given(
    traces(),
    st.sampled_from([0, 4, 7]),
    st.lists(st.integers(1, 8), min_size=1, max_size=2),
    st.sampled_from(["belady", "oracle-lfu"]),
)
def test_offline_policies_behind_front_tiers_match_brute_force(
    records: list[TraceRecord], gpu: int, caps: list[int], policy: str
) -> None:
    gpu = gpu and max(gpu, max(len(r.hash_ids) for r in records))
    starts = [0] * len(records)
    if gpu:
        gpu_tier = RefTier(gpu)
        starts = [serve_on_gpu(gpu_tier, r.hash_ids, [BLOCK] * len(r.hash_ids)) for r in records]
    names = ("CPU", "DISK")
    tiers = tuple(TierConfig(n, c * BLOCK, 1.0) for n, c in zip(names, caps, strict=False))
    result = replay_trace(records, ReplayConfig(tiers, policy, gpu * BLOCK, BLOCK, check_every=1))
    for got, cap in zip(result.tiers, caps, strict=True):
        ends = brute_force(records, starts, cap, policy)
        hits = [range(s, e) for s, e in zip(starts, ends, strict=True)]
        want = sum(
            r.block_tokens(j, BLOCK) for r, hit in zip(records, hits, strict=True) for j in hit
        )
        assert got.hit_tokens == want, got.name
        starts = ends


# Three lower tiers: the third's oracle is the references the first two miss (a mutant
# building every tier's oracle behind the first tier alone passed the two-tier tests).
def test_belady_behind_two_lower_tiers_matches_brute_force() -> None:
    records = [TraceRecord(t, 1, 0, (h,)) for t, h in enumerate([0, 1, 2, 2, 0, 1])]
    names = ("CPU", "DISK", "NVME")
    tiers = tuple(TierConfig(n, BLOCK, 1.0) for n in names)
    result = replay_trace(records, ReplayConfig(tiers, "belady", 0, BLOCK, check_every=1))
    starts = [0] * len(records)
    got, want = [], []
    for tier in result.tiers:
        ends = brute_force(records, starts, 1, "belady")
        got.append(tier.num_hit_blocks)
        want.append(sum(e - s for s, e in zip(starts, ends, strict=True)))
        starts = ends
    assert got == want
    assert want == [1, 1, 1]  # each tier keeps one of the three reused ids
