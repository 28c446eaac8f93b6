"""The CPU → DISK cascade of `TierReplay` against a tiny independent reference (LRU).

The reference restates the cascade model (docs/policies.md) on hash ids with two
OrderedDicts (least recently used first): the lookup takes each block from CPU, else
DISK; the keys CPU lacks are stored into CPU (the request's hits and new blocks pinned;
a full CPU evicts its least recent unpinned key); write-through then writes every newly
stored key DISK lacks; write-back moves each CPU victim to DISK (unless DISK holds it)
as it is evicted. At the end every block the request touched in a tier is refreshed,
last position first.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from replay_helpers import BLOCK, chat_trace, doc_trace

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.policies import EVICTION_POLICIES
from kvtier.replay.cli import main
from kvtier.replay.config import (
    CascadeMode,
    ReleaseOrder,
    ReplayConfig,
    ReplayError,
    TierConfig,
)
from kvtier.replay.tier_replay import TierReplay, replay_trace
from kvtier.replay.trace import TraceRecord, write_trace

WT, WB = CascadeMode.WRITE_THROUGH, CascadeMode.WRITE_BACK
TRACES = {"chat": chat_trace(seed=3), "doc": doc_trace(seed=4)}
BYTES_PER_BLOCK = BLOCK * 131072


@dataclasses.dataclass
class RefState:
    """The reference after one request."""

    cpu: list[int]  # LRU first
    disk: list[int]
    cpu_hit_tokens: int
    disk_hit_tokens: int
    demoted: int
    promoted: int


def _insert(tier: OrderedDict[int, None], h: int, capacity: int, pinned: set[int]) -> bool:
    """Add `h` (unpinned callers refresh it later); evict the LRU unpinned key if full."""
    if len(tier) >= capacity:
        victim = next((k for k in tier if k not in pinned), None)
        if victim is None:
            return False
        del tier[victim]
    tier[h] = None
    return True


def reference(
    records: Sequence[TraceRecord], cpu_cap: int, disk_cap: int, mode: CascadeMode
) -> Iterator[RefState]:
    cpu: OrderedDict[int, None] = OrderedDict()
    disk: OrderedDict[int, None] = OrderedDict()
    cpu_hit = disk_hit = demoted = promoted = 0
    for record in records:
        ids = record.hash_ids
        from_cpu: list[int] = []
        from_disk: list[int] = []
        for h in ids:
            if h in cpu:
                from_cpu.append(h)
            elif h in disk:
                from_disk.append(h)
            else:
                break
        position = {h: j for j, h in enumerate(ids)}
        tokens = {h: min(BLOCK, record.input_length - j * BLOCK) for h, j in position.items()}
        cpu_hit += sum(tokens[h] for h in from_cpu)
        disk_hit += sum(tokens[h] for h in from_disk)
        cpu_pinned, disk_pinned = set(from_cpu), set(from_disk)
        stored: list[int] = []
        for h in [h for h in ids if h not in cpu]:
            if len(cpu) >= cpu_cap:
                victim = next((k for k in cpu if k not in cpu_pinned), None)
                if victim is None:
                    break
                del cpu[victim]
                if mode is WB and victim not in disk:
                    demoted += _insert(disk, victim, disk_cap, disk_pinned)
            cpu[h] = None
            cpu_pinned.add(h)
            stored.append(h)
        promoted += len(set(stored) & set(from_disk))
        written: list[int] = []
        if mode is WT:  # refresh the DISK copies of CPU hits and of stores DISK holds
            kept = [h for h in from_cpu + stored if h in disk and h not in disk_pinned]
            for h in sorted(kept, key=position.__getitem__, reverse=True):
                disk.move_to_end(h)
            for h in [h for h in stored if h not in disk]:
                if not _insert(disk, h, disk_cap, disk_pinned):
                    break
                disk_pinned.add(h)
                written.append(h)
            demoted += len(written)
        for tier, touched in ((cpu, from_cpu + stored), (disk, from_disk + written)):
            for h in sorted(touched, key=position.__getitem__, reverse=True):
                tier.move_to_end(h)
        yield RefState(list(cpu), list(disk), cpu_hit, disk_hit, demoted, promoted)


def key_of(h: int) -> Key:
    return make_key(h.to_bytes(8, "little"), 0)


def lru_order(pool: BlockPool) -> list[Key]:
    """The pool's cached keys in eviction order (nothing is pinned between requests)."""
    order = []
    for b in pool.iter_free_after(None):
        key = pool.key(b)
        if key is not None:
            order.append(key)
    return order


def cached_keys(pool: BlockPool) -> set[Key]:
    return {k for b in range(1, pool.num_blocks) if (k := pool.key(b)) is not None}


def config(
    cpu: int, disk: int, mode: CascadeMode | None, policy: str = "lru", **kw: object
) -> ReplayConfig:
    tiers = (TierConfig("CPU", cpu * BLOCK, 25.0), TierConfig("DISK", disk * BLOCK, 5.0))
    return ReplayConfig(tiers=tiers, policy=policy, block_size=BLOCK, cascade=mode, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(CascadeMode))
@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize(("cpu", "disk"), [(3, 6), (5, 5), (8, 30), (20, 8), (30, 200)])
def test_matches_the_reference_step_by_step(
    mode: CascadeMode, trace: str, cpu: int, disk: int
) -> None:
    records = TRACES[trace]
    replay = TierReplay(records, config(cpu, disk, mode, check_every=1))
    cpu_tier, disk_tier = replay.tiers
    for i, expected in enumerate(reference(records, cpu, disk, mode)):
        replay.step()
        assert lru_order(cpu_tier.pool) == [key_of(h) for h in expected.cpu], f"request {i}"
        assert lru_order(disk_tier.pool) == [key_of(h) for h in expected.disk], f"request {i}"
        assert (cpu_tier.hit_tokens, disk_tier.hit_tokens) == (
            expected.cpu_hit_tokens,
            expected.disk_hit_tokens,
        )
    result = replay.result()
    cpu_result, disk_result = result.tiers
    assert cpu_result.num_demoted_blocks == expected.demoted
    assert cpu_result.num_promoted_blocks == expected.promoted
    assert disk_result.num_stored_blocks == expected.demoted  # DISK is written only so
    assert disk_result.num_demoted_blocks == disk_result.num_promoted_blocks == 0
    assert result.cascade is mode
    total = sum(r.input_length for r in records)
    assert result.token_hit_ratio == pytest.approx(
        (expected.cpu_hit_tokens + expected.disk_hit_tokens) / total
    )


def hand_trace() -> list[TraceRecord]:
    ids = [(1, 2), (3, 4), (1, 2, 5), (1, 2)]  # chained: 2 always follows 1
    return [TraceRecord(i, len(r) * BLOCK, 1, r) for i, r in enumerate(ids)]


@pytest.mark.parametrize(
    ("mode", "demoted", "disk_keys"), [(WB, 3, {2, 3, 4}), (WT, 5, {1, 2, 3, 4, 5})]
)
def test_hits_interleave_tiers_and_cost_each_link(
    mode: CascadeMode, demoted: int, disk_keys: set[int]
) -> None:
    # CPU 3 blocks: request 1 evicts block 2 (to DISK); request 2 hits 1 in CPU, 2 on
    # DISK (promoted back into CPU), misses 5; request 3 hits 1 and the promoted 2 in CPU.
    records = hand_trace()
    replay = TierReplay(records, config(3, 8, mode))
    replay.step()
    replay.step()
    before = replay._ttft_s
    replay.step()
    cost = replay.config.cost
    assert replay._ttft_s - before == pytest.approx(
        BYTES_PER_BLOCK / 25e9 + BYTES_PER_BLOCK / 5e9 + cost.prefill_s(BLOCK)
    )
    replay.step()
    result = replay.result()
    cpu, disk = result.tiers
    assert (cpu.hit_tokens, disk.hit_tokens) == (3 * BLOCK, BLOCK)
    assert (cpu.num_promoted_blocks, cpu.num_demoted_blocks) == (1, demoted)
    assert disk.bytes_stored == demoted * BYTES_PER_BLOCK
    assert cached_keys(replay.tiers[0].pool) == {key_of(h) for h in (1, 2, 5)}
    assert cached_keys(replay.tiers[1].pool) == {key_of(h) for h in disk_keys}


@pytest.mark.parametrize("mode", list(CascadeMode))
@pytest.mark.parametrize("policy", [*EVICTION_POLICIES, "lru+door", "lfuda+door"])
def test_invariants_hold_for_every_policy(mode: CascadeMode, policy: str) -> None:
    for trace in TRACES.values():
        for (cpu, disk), order in zip(((4, 4), (10, 30), (6, 3)), ReleaseOrder, strict=True):
            # check_every=1: every pool and policy is checked after every request
            checked = config(cpu, disk, mode, policy, check_every=1, release_order=order)
            result = replay_trace(trace, checked)
            assert result.tiers[0].num_demoted_blocks == result.tiers[1].num_stored_blocks
    gpu = config(6, 20, mode, policy, check_every=1, gpu_capacity_tokens=80 * BLOCK)
    result = replay_trace(TRACES["chat"], gpu)
    assert result.gpu is not None
    assert result.gpu.hit_tokens > 0


@pytest.mark.parametrize("policy", [*EVICTION_POLICIES, "lru+door"])
@pytest.mark.parametrize("trace", sorted(TRACES))
def test_write_back_disk_never_receives_a_block_the_cpu_keeps(policy: str, trace: str) -> None:
    """Exclusive tiers: DISK only gains blocks leaving the CPU tier. A key is held by both
    only after the CPU tier stored it while DISK held it (a promotion, or a block behind
    the hit prefix computed again), and only while the CPU tier keeps it."""
    records = TRACES[trace]
    replay = TierReplay(records, config(6, 12, WB, policy))
    cpu_pool, disk_pool = replay.tiers[0].pool, replay.tiers[1].pool
    cpu, disk = set[Key](), set[Key]()
    for _ in records:
        replay.step()
        cpu_after, disk_after = cached_keys(cpu_pool), cached_keys(disk_pool)
        assert not (disk_after - disk) & cpu_after, "DISK gained a key the CPU still holds"
        new_overlap = (cpu_after & disk_after) - (cpu & disk)
        assert new_overlap <= (cpu_after - cpu) & disk, "a key entered both tiers otherwise"
        cpu, disk = cpu_after, disk_after
    assert replay.result().tiers[0].num_promoted_blocks > 0


@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("cpu", [3, 8, 20])
def test_write_through_disk_covers_the_cpu_until_disk_evicts(trace: str, cpu: int) -> None:
    """With DISK at least as large as CPU (lru), every block the CPU tier stores is on
    DISK right after the request, unless DISK held it already when the writes were
    selected (no write, no refresh: the request's own writes may evict that copy, as in
    the offload scheduler); with a DISK that never evicts, DISK ⊇ CPU after every
    request."""
    records = TRACES[trace]
    distinct = len({h for r in records for h in r.hash_ids})
    for disk in (cpu, 2 * cpu, distinct):
        replay = TierReplay(records, config(cpu, disk, WT))
        cpu_pool, disk_pool = replay.tiers[0].pool, replay.tiers[1].pool
        cpu_keys, disk_keys = set[Key](), set[Key]()
        for _ in records:
            replay.step()
            cpu_after, disk_after = cached_keys(cpu_pool), cached_keys(disk_pool)
            assert (cpu_after - cpu_keys) - disk_after <= disk_keys, "a CPU store missed DISK"
            if disk == distinct:
                assert cpu_after <= disk_after
            cpu_keys, disk_keys = cpu_after, disk_after
        assert replay.tiers[1].dropped == 0


def test_write_through_cpu_hits_refresh_the_disk_copy() -> None:
    """A block kept hot by CPU hits stays fresh on DISK too, so DISK keeps covering the CPU
    tier (without the refresh, block 1 would age out of DISK while the CPU holds it)."""
    ids = [(1,), (2,), (1,), (3,)]
    records = [TraceRecord(i, BLOCK, 1, r) for i, r in enumerate(ids)]
    replay = TierReplay(records, config(2, 2, WT))
    replay.run()
    assert cached_keys(replay.tiers[0].pool) == {key_of(1), key_of(3)}
    assert cached_keys(replay.tiers[1].pool) == {key_of(1), key_of(3)}


def test_write_back_holds_more_than_write_through() -> None:
    records = TRACES["chat"]
    results = {m: replay_trace(records, config(10, 30, m)) for m in CascadeMode}
    wb, wt = results[WB], results[WT]
    assert wb.token_hit_ratio >= wt.token_hit_ratio
    assert wb.tiers[1].num_stored_blocks < wt.tiers[1].num_stored_blocks  # fewer disk writes
    # The CPU tier itself behaves as without a DISK tier behind it, in both modes.
    alone = replay_trace(
        records, ReplayConfig(tiers=(config(10, 30, None).tiers[0],), block_size=BLOCK)
    )
    for result in results.values():
        assert result.tiers[0].hit_tokens == alone.tiers[0].hit_tokens


def test_default_keeps_independent_tiers() -> None:
    records = TRACES["doc"]
    result = replay_trace(records, config(5, 50, None))
    assert result.cascade is None
    assert all(t.num_demoted_blocks == t.num_promoted_blocks == 0 for t in result.tiers)


def test_cascade_configuration_is_validated() -> None:
    cpu, disk = TierConfig("CPU", 10 * BLOCK, 25.0), TierConfig("DISK", 10 * BLOCK, 5.0)
    for tiers in ((cpu,), (disk, cpu), (cpu, disk, disk)):
        with pytest.raises(ReplayError, match="needs exactly two lower tiers, CPU then DISK"):
            ReplayConfig(tiers=tiers, block_size=BLOCK, cascade=WB)
    with pytest.raises(ReplayError, match="online policies only"):
        ReplayConfig(tiers=(cpu, disk), policy="belady", block_size=BLOCK, cascade=WT)
    with pytest.raises(ReplayError, match="unknown cascade mode 'write_around'"):
        ReplayConfig(tiers=(cpu, disk), block_size=BLOCK, cascade="write_around")  # type: ignore[arg-type]
    by_value = ReplayConfig(tiers=(cpu, disk), block_size=BLOCK, cascade="write_back")  # type: ignore[arg-type]
    assert by_value.cascade is WB


def test_cli_cascade(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "doc.jsonl"
    write_trace(path, doc_trace(seed=5, num_requests=60))
    out = tmp_path / "r.json"
    argv = [str(path), "--block-size", str(BLOCK), "--quiet", "--cpu", "40", "--disk", "160"]
    assert main([*argv, "--cascade", "write_back", "--json", str(out)]) == 0
    assert "to-disk:" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert set(data["token_hit_ratio"]) == {"lru"}  # no Belady line for a cascade
    assert data["points"][0]["cascade"] == "write_back"
    point = data["points"][0]
    assert "disk_token_hit_ratio" in point
    for total in ("blocks_stored", "blocks_evicted", "bytes_stored", "bytes_loaded"):
        assert point[total] == point[f"cpu_{total}"] + point[f"disk_{total}"] > 0, total
    assert main([*argv[:4], "--cpu", "40", "--cascade", "write_through"]) == 2
    assert "needs a DISK tier" in capsys.readouterr().err
    assert main([*argv, "--cascade", "write_through", "--policy", "belady"]) == 2
    assert "online policies only" in capsys.readouterr().err


@pytest.mark.parametrize("policy", [*sorted(EVICTION_POLICIES), "lru+door", "arc+door"])
@pytest.mark.parametrize("seed", range(4))
def test_write_back_cpu_tier_hits_as_it_would_alone(policy: str, seed: int) -> None:
    """A write-back demotion is the CPU tier's eviction (`BlockPool.evict_keys`): with
    one-block requests (a DISK hit then changes no CPU lookup) the CPU tier hits exactly
    as it does with no DISK behind it, for every policy. Before, demotions skipped ARC's
    and S3-FIFO's ghosts and LFU-DA's aging (docs/policies.md)."""
    rng = random.Random(seed)
    hot = list(range(12))
    ids = [rng.choice(hot) if rng.random() < 0.6 else 100 + i for i in range(400)]
    records = [TraceRecord(i, BLOCK, 1, (h,)) for i, h in enumerate(ids)]
    cpu = TierConfig("CPU", 6 * BLOCK, 25.0)
    disk = TierConfig("DISK", 6 * BLOCK, 5.0)
    alone = ReplayConfig(tiers=(cpu,), policy=policy, block_size=BLOCK, check_every=1)
    cascade = dataclasses.replace(
        alone, tiers=(cpu, disk), cascade=CascadeMode.WRITE_BACK, check_every=1
    )
    alone_cpu = replay_trace(records, alone).tiers[0]
    cascade_cpu, cascade_disk = replay_trace(records, cascade).tiers
    assert cascade_disk.num_hit_blocks > 0
    assert cascade_cpu.num_hit_blocks == alone_cpu.num_hit_blocks
    assert cascade_cpu.num_stored_blocks == alone_cpu.num_stored_blocks
