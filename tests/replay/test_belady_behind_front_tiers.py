"""`belady` stays the upper bound of block hits with tiers in front (issue 6's reference line).

A lower tier behind the GPU tier, or the DISK tier behind an independent CPU tier, sees
only the references the tiers in front do not serve. Belady ranks and admits by the
next reference that reaches its own tier (`FutureOracle(reach_from=...)`); ranked by
the next reference in the trace, it refused blocks whose would-be victim is never asked
for again there, and an online policy beat it (docs/policies.md).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from replay_helpers import BLOCK

from kvtier.core.keys import make_key
from kvtier.replay.belady import NEVER, FutureOracle
from kvtier.replay.sweep import run_sweep, sweep_passes
from kvtier.replay.tier_replay import ReplayConfig, TierConfig, replay_trace
from kvtier.replay.trace import TraceRecord

ONLINE = ("lru", "arc", "s3fifo", "lfuda", "duel", "lru+door", "arc+door")


def records_of(rows: list[tuple[int, ...]]) -> list[TraceRecord]:
    return [TraceRecord(i, len(ids) * BLOCK, 1, ids) for i, ids in enumerate(rows)]


def lower_hit_blocks(
    records: list[TraceRecord], policy: str, tiers: tuple[TierConfig, ...], gpu_tokens: int
) -> int:
    config = ReplayConfig(
        tiers=tiers,
        policy=policy,
        gpu_capacity_tokens=gpu_tokens,
        block_size=BLOCK,
        check_every=1,
    )
    return sum(tier.num_hit_blocks for tier in replay_trace(records, config).tiers)


def test_disk_behind_cpu_ranks_by_the_references_that_reach_disk() -> None:
    """CPU 1 block, DISK 1 block, requests [0], [0, 1], [0, 1]: the CPU serves block 0
    from request 1 on, so DISK should keep block 1. Ranked by block 0's references at
    requests 1 and 2 (the CPU's), Belady refused block 1 on DISK: 0.4 of LRU's 0.6."""
    records = records_of([(0,), (0, 1), (0, 1)])
    tiers = (TierConfig("CPU", BLOCK, 25.0), TierConfig("DISK", BLOCK, 5.0))
    lru = replay_trace(records, ReplayConfig(tiers=tiers, block_size=BLOCK))
    belady = replay_trace(records, ReplayConfig(tiers=tiers, policy="belady", block_size=BLOCK))
    assert lru.token_hit_ratio == pytest.approx(0.6)
    assert belady.token_hit_ratio == pytest.approx(0.6)
    assert [t.num_hit_blocks for t in belady.tiers] == [2, 1]


def test_cpu_behind_a_gpu_tier_ranks_by_the_references_the_gpu_misses() -> None:
    """GPU 5 blocks, CPU 1 block (a case the random test below found): most of block
    100's references are GPU hits. Ranked by them, Belady's CPU kept refusing blocks for
    a block 100 the CPU was never asked for, and scored 0 hits to `lru+door`'s 1."""
    records = records_of(
        [
            (100, 101, 102),
            (100, 101, 102, 103, 104),
            (100, 101, 105, 106),
            (107, 108),
            (100, 109, 110, 111),
            (100, 101, 112),
            (100, 101, 112, 113),
            (100,),
            (100, 101),
        ]
    )
    tiers = (TierConfig("CPU", BLOCK, 25.0),)
    belady = lower_hit_blocks(records, "belady", tiers, 5 * BLOCK)
    assert belady == 1
    for policy in ONLINE:
        assert lower_hit_blocks(records, policy, tiers, 5 * BLOCK) <= belady, policy


def test_reach_from_counts_only_references_that_reach_the_tier() -> None:
    a, b = make_key(b"a" * 8, 0), make_key(b"b" * 8, 0)
    rows = [[a, b], [a, b], [a]]
    # References 0-4: a b | a b | a. Requests 1 and 2 reach the tier from position 1 on:
    # `a` is served in front there, so only b's second reference (3) reaches it later.
    oracle = FutureOracle(rows, reach_from=[0, 1, 1])
    oracle.on_request(0)
    assert (oracle.next_use(a), oracle.uses_left(a)) == (NEVER, 0)
    assert (oracle.next_use(b), oracle.uses_left(b)) == (3, 1)
    oracle.on_request(1)  # a reference in front is still told the next one that reaches
    assert (oracle.next_use(a), oracle.next_use(b)) == (NEVER, NEVER)
    everything = FutureOracle(rows)
    everything.on_request(0)
    assert (everything.next_use(a), everything.uses_left(a)) == (2, 2)
    with pytest.raises(ValueError, match="reach_from has 2 entries for 3 requests"):
        FutureOracle(rows, reach_from=[0, 0])


def random_rows(rng: random.Random) -> list[tuple[int, ...]]:
    """Requests that share prefixes of earlier ones, then add 0-3 new blocks."""
    roots: list[tuple[int, ...]] = []
    rows = []
    next_id = 100
    for _ in range(rng.randint(2, 14)):
        ids: tuple[int, ...] = ()
        if roots and rng.random() < 0.7:
            root = rng.choice(roots)
            ids = root[: rng.randint(1, len(root))]
        new = rng.randint(0 if ids else 1, 3)
        ids += tuple(range(next_id, next_id + new))
        next_id += new
        if rng.random() < 0.5:
            roots.append(ids)
        rows.append(ids)
    return rows


@pytest.mark.parametrize("seed", range(150))
def test_no_online_policy_beats_belady_with_tiers_in_front(seed: int) -> None:
    """Random prefix-sharing traces, a GPU tier in front or not, one or two lower tiers:
    every online policy's lower-tier block hits stay at or below Belady's (16 of the
    first 300 seeds broke this before the fix)."""
    rng = random.Random(seed)
    rows = random_rows(rng)
    records = records_of(rows)
    longest = max(len(ids) for ids in rows)
    gpu_tokens = rng.choice([0, 0, longest, longest + 1, longest + 2]) * BLOCK
    tiers = [TierConfig("CPU", rng.randint(1, 4) * BLOCK, 25.0)]
    if rng.random() < 0.5:
        tiers.append(TierConfig("DISK", rng.randint(1, 4) * BLOCK, 5.0))
    bound = lower_hit_blocks(records, "belady", tuple(tiers), gpu_tokens)
    for policy in ONLINE:
        assert lower_hit_blocks(records, policy, tuple(tiers), gpu_tokens) <= bound, policy


@pytest.mark.parametrize("gpu_blocks", [0, 3])
@pytest.mark.parametrize("num_tiers", [1, 2])
def test_a_sweep_shares_the_first_tier_oracle_and_reports_every_pass(
    gpu_blocks: int, num_tiers: int
) -> None:
    """The sweep builds the first tier's oracle once (one pass of the GPU tier alone, which
    no lower tier affects): each point equals its replay built alone, and the progress
    callback hears of every pass `sweep_passes` counts, setup passes included."""
    records = records_of([(0, 1), (0, 1), (2, 3), (0, 1), (2,), (0, 1, 4), (2, 3), (0, 1, 4)])
    tiers = [TierConfig("CPU", 2 * BLOCK, 25.0), TierConfig("DISK", 2 * BLOCK, 5.0)]
    base = ReplayConfig(
        tiers=tuple(tiers[:num_tiers]), gpu_capacity_tokens=gpu_blocks * BLOCK, block_size=BLOCK
    )
    policies, capacities = ["belady", "lru", "oracle-lfu"], [BLOCK, 2 * BLOCK, 3 * BLOCK]
    heard: list[int] = []
    points = run_sweep(records, base, policies, capacities, heard.append)
    assert sum(heard) == sweep_passes(base, policies, capacities) * len(records)
    assert sweep_passes(base, policies, capacities) == 9 + 2 * 3 * (num_tiers - 1) + (
        gpu_blocks > 0
    )
    for point in points:
        first = replace(base.tiers[0], capacity_tokens=point.capacity_tokens)
        config = replace(base, policy=point.policy, tiers=(first, *base.tiers[1:]))
        heard.clear()
        assert point.result.tiers == replay_trace(records, config, progress=heard.append).tiers
        assert sum(heard) == sweep_passes(config, [point.policy], [0]) * len(records)


def test_a_replay_refuses_an_oracle_built_for_another_gpu_tier() -> None:
    records = records_of([(0, 1), (0, 1), (2,)])
    keys = [[make_key(h.to_bytes(8, "little"), 0) for h in r.hash_ids] for r in records]
    config = ReplayConfig(
        tiers=(TierConfig("CPU", BLOCK, 25.0),),
        policy="belady",
        gpu_capacity_tokens=2 * BLOCK,
        block_size=BLOCK,
    )
    with pytest.raises(ValueError, match="built for a GPU tier of 0 tokens, this replay has 16"):
        replay_trace(records, config, keys, FutureOracle(keys))
