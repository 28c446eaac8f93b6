"""`TierReplay` against tiny independent references: an OrderedDict LRU, a brute-force Belady.

The references restate the replay model (docs/policies.md) directly on keys: prefix
lookup, the request's hit and newly stored blocks pinned until it ends, the keys missing
when the selection starts stored in position order, then every touched block refreshed
last position first.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from replay_helpers import BLOCK, chat_trace, doc_trace

from kvtier.core.policies import EVICTION_POLICIES
from kvtier.replay.tier_replay import (
    CascadeMode,
    ReplayConfig,
    ReplayError,
    TierConfig,
    TierReplay,
    max_blocks_held,
    replay_trace,
    trace_keys,
)
from kvtier.replay.trace import TraceRecord

NEVER = float("inf")


def tokens_of(record: TraceRecord, n: int) -> int:
    return min(n * BLOCK, record.input_length)


def reference_lru(records: Sequence[TraceRecord], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()  # LRU first
    hit_tokens = 0
    for record in records:
        ids = record.hash_ids
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        hit_tokens += tokens_of(record, n)
        pinned = set(ids[:n])
        touched = list(ids[:n])
        for h in [h for h in ids if h not in cache]:  # missing when the selection starts
            if len(cache) >= capacity:
                victim = next((k for k in cache if k not in pinned), None)
                if victim is None:
                    break  # every slot is pinned by this request
                del cache[victim]
            cache[h] = None
            pinned.add(h)
            touched.append(h)
        position = {h: j for j, h in enumerate(ids)}
        for h in sorted(touched, key=position.__getitem__, reverse=True):
            cache.move_to_end(h)
    return hit_tokens / sum(r.input_length for r in records)


def reference_belady(records: Sequence[TraceRecord], capacity: int) -> float:
    flat = [h for r in records for h in r.hash_ids]

    def next_use(h: int, after: int) -> float:
        for p in range(after + 1, len(flat)):
            if flat[p] == h:
                return p
        return NEVER

    cache: set[int] = set()
    hit_tokens = 0
    end = -1
    for record in records:
        ids = record.hash_ids
        end += len(ids)
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        hit_tokens += tokens_of(record, n)
        pinned = set(ids[:n])
        for h in [h for h in ids if h not in cache]:
            mine = next_use(h, end)
            if mine == NEVER:
                continue
            if len(cache) >= capacity:
                candidates = [k for k in cache if k not in pinned]
                if not candidates:
                    break
                victim = max(candidates, key=lambda k: next_use(k, end))
                if next_use(victim, end) <= mine:
                    continue  # storing it would evict a block needed sooner
                cache.remove(victim)
            cache.add(h)
            pinned.add(h)
    return hit_tokens / sum(r.input_length for r in records)


def replay(records: Sequence[TraceRecord], policy: str, capacity: int, **kw: object) -> float:
    tier = TierConfig("CPU", capacity * BLOCK, 25.0)
    config = ReplayConfig(tiers=(tier,), policy=policy, block_size=BLOCK, check_every=7, **kw)  # type: ignore[arg-type]
    return replay_trace(records, config).token_hit_ratio


TRACES = {"chat": chat_trace(seed=3), "doc": doc_trace(seed=4)}


@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("capacity", [3, 10, 30, 100])
def test_lru_matches_an_ordered_dict(trace: str, capacity: int) -> None:
    records = TRACES[trace]
    assert replay(records, "lru", capacity) == pytest.approx(reference_lru(records, capacity))


@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("capacity", [3, 10, 30])
def test_belady_matches_brute_force(trace: str, capacity: int) -> None:
    records = TRACES[trace]
    assert replay(records, "belady", capacity) == pytest.approx(reference_belady(records, capacity))


@pytest.mark.parametrize("policy", [*EVICTION_POLICIES, "lru+door", "lfuda+door"])
def test_no_policy_beats_belady_and_invariants_hold(policy: str) -> None:
    records = TRACES["doc"]
    for capacity in (4, 20):
        assert replay(records, policy, capacity) <= replay(records, "belady", capacity) + 1e-9


def test_infinite_capacity_reaches_every_reuse() -> None:
    records = TRACES["chat"]
    distinct = len({h for r in records for h in r.hash_ids})
    for policy in EVICTION_POLICIES:
        assert replay(records, policy, distinct) == pytest.approx(reference_lru(records, distinct))


def test_gpu_tier_serves_first_and_lower_tier_continues() -> None:
    records = TRACES["chat"]
    cpu = TierConfig("CPU", 40 * BLOCK, 25.0)
    with_gpu = ReplayConfig(tiers=(cpu,), gpu_capacity_tokens=60 * BLOCK, block_size=BLOCK)
    result = replay_trace(records, with_gpu)
    assert result.gpu is not None
    assert result.gpu.token_hit_ratio > 0
    assert result.total_token_hit_ratio == pytest.approx(
        result.gpu.token_hit_ratio + result.token_hit_ratio
    )
    alone = replay_trace(records, ReplayConfig(tiers=(cpu,), block_size=BLOCK))
    # The GPU in front can only add hits: the CPU tier still receives every block.
    assert result.total_token_hit_ratio >= alone.token_hit_ratio - 1e-9


def test_belady_behind_a_gpu_tier_ranks_a_block_the_gpu_served_by_its_next_use() -> None:
    """A GPU hit does not touch the lower tier, but Belady ranks the block by its next
    use from there on: A, served by the GPU at request 1, is never used again, so C
    (used again at request 5) replaces it; ranked by its use at request 1, A stayed and
    B was the would-be victim, so C (needed after B) was refused and missed at 5."""
    a, b, c = 1, 2, 3
    records = [TraceRecord(i, BLOCK, 1, (h,)) for i, h in enumerate([a, a, b, c, b, c])]
    cpu = TierConfig("CPU", 2 * BLOCK, 25.0)
    config = ReplayConfig(
        tiers=(cpu,), policy="belady", gpu_capacity_tokens=BLOCK, block_size=BLOCK, check_every=1
    )
    result = replay_trace(records, config)
    assert result.gpu is not None
    assert result.gpu.hit_tokens == BLOCK  # A at request 1
    (tier,) = result.tiers
    assert tier.hit_tokens == 2 * BLOCK  # B at request 4, C at request 5


def test_disk_tier_continues_after_cpu() -> None:
    records = TRACES["doc"]
    cpu = TierConfig("CPU", 5 * BLOCK, 25.0)
    disk = TierConfig("DISK", 50 * BLOCK, 5.0)
    result = replay_trace(records, ReplayConfig(tiers=(cpu, disk), block_size=BLOCK))
    cpu_result, disk_result = result.tiers
    assert disk_result.hit_tokens > 0
    assert result.token_hit_ratio == pytest.approx(
        cpu_result.token_hit_ratio + disk_result.token_hit_ratio
    )
    assert disk_result.bytes_loaded == disk_result.num_hit_blocks * BLOCK * 131072


def test_counts_and_ttft_are_consistent() -> None:
    records = TRACES["doc"]
    result = replay_trace(
        records, ReplayConfig(tiers=(TierConfig("CPU", 10 * BLOCK, 25.0),), block_size=BLOCK)
    )
    (tier,) = result.tiers
    assert tier.num_stored_blocks >= tier.num_evicted_blocks >= 0
    assert tier.num_stored_blocks - tier.num_evicted_blocks <= tier.num_blocks
    assert 0 < result.mean_ttft_s < result.mean_ttft_no_cache_s


def test_gpu_too_small_for_a_request_names_it_before_the_replay() -> None:
    records = TRACES["doc"]
    sizes = [len(r.hash_ids) for r in records]
    largest = sizes.index(max(sizes))
    config = ReplayConfig(
        tiers=(TierConfig("CPU", 10 * BLOCK, 25.0),),
        gpu_capacity_tokens=(max(sizes) - 1) * BLOCK,
        block_size=BLOCK,
    )
    with pytest.raises(ReplayError, match=rf"request {largest} \(0-based\) needs {max(sizes)} GPU"):
        TierReplay(records, config)  # the constructor checks: no request is replayed
    fits = dataclasses.replace(config, gpu_capacity_tokens=max(sizes) * BLOCK)
    TierReplay(records, fits).run()


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        ReplayConfig(tiers=(TierConfig("CPU", 1000, 25.0),), policy="nope")
    with pytest.raises(ReplayError, match="holds no 512-token block"):
        ReplayConfig(tiers=(TierConfig("CPU", 100, 25.0),))
    with pytest.raises(ReplayError, match="capacity must be > 0 tokens, got 0"):
        TierConfig("CPU", 0, 25.0)
    with pytest.raises(ReplayError, match=r"'belady' is offline.*no admission filter"):
        ReplayConfig(tiers=(TierConfig("CPU", 1000, 25.0),), policy="belady+door")
    with pytest.raises(ReplayError, match="gpu capacity must be 0"):
        ReplayConfig(tiers=(TierConfig("CPU", 1000, 25.0),), gpu_capacity_tokens=100)


def test_blocks_held_counts_distinct_keys() -> None:
    records = [TraceRecord(0, 24, 1, (1, 2, 3)), TraceRecord(1, 16, 1, (1, 4))]
    assert max_blocks_held(trace_keys(records, 8)) == 4


CAPPED_POLICIES = [*EVICTION_POLICIES, "lru+door", "belady", "oracle-lfu"]
CAPPED_CASES = [("cpu", p) for p in CAPPED_POLICIES] + [
    ("gpu+cpu+disk", p) for p in CAPPED_POLICIES
]
CAPPED_CASES += [(mode.value, p) for mode in CascadeMode for p in CAPPED_POLICIES[:-2]]


def capped_config(setup: str, policy: str, num_blocks: int) -> ReplayConfig:
    big = num_blocks * BLOCK
    cpu, disk = TierConfig("CPU", big, 25.0), TierConfig("DISK", big, 5.0)
    if setup == "cpu":
        return ReplayConfig(tiers=(cpu,), policy=policy, block_size=BLOCK, check_every=11)
    if setup == "gpu+cpu+disk":
        small_cpu = TierConfig("CPU", 5 * BLOCK, 25.0)  # evicts: only DISK and GPU are capped
        return ReplayConfig(
            tiers=(small_cpu, disk), policy=policy, gpu_capacity_tokens=big, block_size=BLOCK
        )
    small_cpu = TierConfig("CPU", 7 * BLOCK, 25.0)
    mode = CascadeMode(setup)
    return ReplayConfig(tiers=(small_cpu, disk), policy=policy, block_size=BLOCK, cascade=mode)


@pytest.mark.parametrize(("setup", "policy"), CAPPED_CASES)
def test_a_tier_larger_than_the_trace_is_capped_with_identical_results(
    setup: str, policy: str
) -> None:
    records = TRACES["chat"]
    cap = max_blocks_held(trace_keys(records, BLOCK))
    config = capped_config(setup, policy, 5 * cap)
    capped = TierReplay(records, config)
    full = TierReplay(records, config, max_tier_blocks=10 * cap)  # no cap: 5 x cap blocks
    assert max(t.pool.num_usable_blocks for t in capped.tiers) == cap
    assert max(t.pool.num_usable_blocks for t in full.tiers) == 5 * cap
    if capped.gpu_pool is not None:
        assert capped.gpu_pool.num_usable_blocks == cap
    a = dataclasses.replace(capped.run(), runtime_s=0.0)
    b = dataclasses.replace(full.run(), runtime_s=0.0)
    assert a == b
    assert max(t.num_blocks for t in a.tiers) == 5 * cap  # the configured size is reported


def test_a_huge_capacity_allocates_what_the_trace_holds() -> None:
    records = TRACES["doc"]
    huge = TierConfig("CPU", 10**18, 25.0)
    config = ReplayConfig(tiers=(huge,), gpu_capacity_tokens=10**18, block_size=BLOCK)
    replay = TierReplay(records, config)
    cap = max_blocks_held(replay.keys)
    assert replay.tiers[0].pool.num_usable_blocks == cap
    result = replay.run()
    assert result.tiers[0].num_blocks == 10**18 // BLOCK
    assert result.gpu is not None
    assert result.gpu.num_blocks == 10**18 // BLOCK


def test_the_gpu_row_counts_its_hit_blocks() -> None:
    """The GPU row's hit blocks agree with its hit tokens: request 1 hits A (a whole
    block) and request 2 hits A and B (B partial), so 3 blocks and 2.5 blocks' tokens."""
    a, b = 1, 2
    half = BLOCK // 2
    records = [
        TraceRecord(0, BLOCK + half, 1, (a, b)),
        TraceRecord(1, BLOCK, 1, (a,)),
        TraceRecord(2, BLOCK + half, 1, (a, b)),
    ]
    cpu = TierConfig("CPU", 4 * BLOCK, 25.0)
    config = ReplayConfig(tiers=(cpu,), gpu_capacity_tokens=4 * BLOCK, block_size=BLOCK)
    result = replay_trace(records, config)
    assert result.gpu is not None
    assert result.gpu.hit_tokens == 2 * BLOCK + half
    assert result.gpu.num_hit_blocks == 3
