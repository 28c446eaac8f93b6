"""Every number of a replay against a tiny independent reference, on random small traces.

test_tier_replay.py checks one LRU tier's hit ratio and test_cascade.py the cascade's
hits; here the reference (OrderedDicts, least recently used first) also has a GPU tier
in front and computes what the report prints: per-tier hit tokens and blocks, blocks
stored, evicted, dropped, bytes stored and loaded, and the mean TTFT by the cost
model's formula (docs/policies.md, "The replay model" and "The cascade").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_model import BLOCK, RefTier, refresh, serve_on_gpu, store, traces

from example_counts import scaled_examples
from kvtier.replay.cli import main
from kvtier.replay.cost import CostModel
from kvtier.replay.tier_replay import (
    CascadeMode,
    ReleaseOrder,
    ReplayConfig,
    TierConfig,
    replay_trace,
)
from kvtier.replay.trace import TraceRecord, write_trace

COST = CostModel(prefill_tokens_per_s=1000.0, bytes_per_token=3)
LINKS = (2.0, 0.5)
WT, WB = CascadeMode.WRITE_THROUGH, CascadeMode.WRITE_BACK
TAIL_FIRST = ReleaseOrder.TAIL_FIRST


def in_tier(tiers: Sequence[RefTier], h: int) -> int | None:
    return next((t for t, tier in enumerate(tiers) if h in tier.cache), None)


def demote_to(disk: RefTier, pinned: set[int], h: int) -> None:
    """Write back a CPU victim: into DISK unless held there, freed at once (its MRU)."""
    if h not in disk.cache:
        store(disk, [h], [0], pinned)
        pinned.discard(h)


def reference(
    records: Sequence[TraceRecord],
    gpu: int,
    caps: Sequence[int],
    mode: CascadeMode | None,
    order: ReleaseOrder = TAIL_FIRST,
) -> tuple[int, list[RefTier], float]:
    """Return GPU hit tokens, the lower tiers and the summed TTFT (LRU everywhere)."""
    tiers = [RefTier(c) for c in caps]
    gpu_tier = RefTier(gpu)
    ttft = 0.0
    for r in records:
        ids = r.hash_ids
        tokens = [min(BLOCK, r.input_length - j * BLOCK) for j in range(len(ids))]
        end = serve_on_gpu(gpu_tier, ids, tokens) if gpu else 0
        hits: list[list[int]] = [[] for _ in tiers]
        if mode is None:  # each tier continues where the one before stopped
            for tier, hit in zip(tiers, hits, strict=True):
                while end < len(ids) and ids[end] in tier.cache:
                    hit.append(end)
                    end += 1
        else:  # each block from CPU, else DISK
            while end < len(ids) and (t := in_tier(tiers, ids[end])) is not None:
                hits[t].append(end)
                end += 1
        for tier, link, hit in zip(tiers, LINKS, hits, strict=False):
            tier.hit_tokens += sum(tokens[j] for j in hit)
            tier.hit_blocks += len(hit)
            ttft += COST.load_s(len(hit) * BLOCK * COST.bytes_per_token, link)
        ttft += COST.prefill_s(sum(tokens[end:]))
        pins = [{ids[j] for j in hit} for hit in hits]
        if mode is None and order is not TAIL_FIRST:  # loads freed before the stores
            root_last = order is ReleaseOrder.SCHEDULER_TAIL_FIRST
            for tier, hit in zip(tiers, hits, strict=True):
                refresh(tier.cache, ids, hit, root_last)
                new = store(tier, ids, range(len(ids)), set())
                refresh(tier.cache, ids, new, root_last)
            continue
        if mode is None:
            for tier, hit, pinned in zip(tiers, hits, pins, strict=True):
                refresh(tier.cache, ids, [*hit, *store(tier, ids, range(len(ids)), pinned)])
            continue
        cpu, disk = tiers
        demote = partial(demote_to, disk, pins[1]) if mode is WB else None
        new = store(cpu, ids, range(len(ids)), pins[0], demote)
        written: list[int] = []
        if mode is WT:
            served = set(hits[1])
            held = [j for j in [*hits[0], *new] if j not in served and ids[j] in disk.cache]
            refresh(disk.cache, ids, held)
            written = store(disk, ids, new, pins[1])
        refresh(cpu.cache, ids, [*hits[0], *new])
        refresh(disk.cache, ids, [*hits[1], *written])
    return gpu_tier.hit_tokens, tiers, ttft


def check(
    records: list[TraceRecord],
    gpu: int,
    caps: list[int],
    mode: CascadeMode | None,
    order: ReleaseOrder = TAIL_FIRST,
) -> None:
    names = ("CPU", "DISK")
    tiers = tuple(
        TierConfig(n, c * BLOCK, link) for n, c, link in zip(names, caps, LINKS, strict=False)
    )
    config = ReplayConfig(tiers, "lru", gpu * BLOCK, BLOCK, order, COST, 1, mode)
    result = replay_trace(records, config)
    gpu_hits, ref, ttft = reference(records, gpu, caps, mode, order)
    total = sum(r.input_length for r in records)
    bpb = BLOCK * COST.bytes_per_token
    assert (result.gpu.hit_tokens if result.gpu else 0) == gpu_hits
    for got, want in zip(result.tiers, ref, strict=True):
        assert got.hit_tokens == want.hit_tokens, got.name
        assert got.token_hit_ratio == pytest.approx(want.hit_tokens / max(1, total))
        assert got.num_hit_blocks == want.hit_blocks
        assert got.num_stored_blocks == want.stored, got.name
        assert got.num_dropped_blocks == want.dropped, got.name
        assert got.num_evicted_blocks == want.stored - len(want.cache), got.name
        assert got.bytes_stored == want.stored * bpb
        assert got.bytes_loaded == want.hit_blocks * bpb
    lower = sum(t.hit_tokens for t in ref)
    assert result.total_token_hit_ratio == pytest.approx((lower + gpu_hits) / max(1, total))
    assert result.mean_ttft_s == pytest.approx(ttft / len(records))
    assert result.mean_ttft_no_cache_s == pytest.approx(total / 1000.0 / len(records))


GPU = st.sampled_from([0, 4, 7])  # blocks; a request has at most 4 + its prefix's


@settings(max_examples=scaled_examples(400), deadline=None)
@given(
    traces(),
    GPU,
    st.lists(st.integers(1, 12), min_size=1, max_size=2),
    st.sampled_from(list(ReleaseOrder)),
)
def test_independent_tiers_match_the_reference(
    records: list[TraceRecord], gpu: int, caps: list[int], order: ReleaseOrder
) -> None:
    gpu = gpu and max(gpu, max(len(r.hash_ids) for r in records))
    check(records, gpu, caps, None, order)


@settings(max_examples=scaled_examples(400), deadline=None)
@given(traces(), GPU, st.integers(1, 10), st.integers(1, 12), st.sampled_from([WT, WB]))
def test_cascade_matches_the_reference(
    records: list[TraceRecord], gpu: int, cpu: int, disk: int, mode: CascadeMode
) -> None:
    gpu = gpu and max(gpu, max(len(r.hash_ids) for r in records))
    check(records, gpu, [cpu, disk], mode)


@settings(max_examples=scaled_examples(25), deadline=None)
@given(traces(), st.integers(1, 6), st.integers(1, 12), st.sampled_from([None, WT, WB]))
def test_the_cli_json_reports_the_reference_numbers(
    tmp_path_factory: pytest.TempPathFactory,
    records: list[TraceRecord],
    cpu: int,
    disk: int,
    mode: CascadeMode | None,
) -> None:
    """Every option of the cost model, the block size and the capacities reach the JSON."""
    path = tmp_path_factory.mktemp("cli") / "t.jsonl"
    write_trace(path, records)
    gpu = max(7, max(len(r.hash_ids) for r in records))
    disk = max(disk, cpu) if mode is WT else disk
    argv = [str(path), "--block-size", str(BLOCK), "--quiet", "--json", str(path) + ".json"]
    argv += ["--gpu-capacity", str(gpu * BLOCK), "--cpu", str(cpu * BLOCK)]
    argv += ["--disk", str(disk * BLOCK), "--prefill-tokens-per-s", "1000"]
    argv += ["--bytes-per-token", "3", "--cpu-link-gbps", "2", "--disk-link-gbps", "0.5"]
    assert main([*argv, *(["--cascade", mode.value] if mode else [])]) == 0
    (point,) = [
        p
        for p in json.loads(Path(str(path) + ".json").read_text())["points"]
        if p["policy"] == "lru"
    ]
    gpu_hits, ref, ttft = reference(records, gpu, [cpu, disk], mode)
    total = max(1, sum(r.input_length for r in records))
    assert point["gpu_token_hit_ratio"] == round(gpu_hits / total, 6)
    for name, tier in zip(("cpu", "disk"), ref, strict=True):
        assert point[f"{name}_token_hit_ratio"] == round(tier.hit_tokens / total, 6)
        assert point[f"{name}_blocks_stored"] == tier.stored
        assert point[f"{name}_blocks_evicted"] == tier.stored - len(tier.cache)
        assert point[f"{name}_bytes_loaded"] == tier.hit_blocks * BLOCK * 3
    assert point["mean_ttft_s"] == round(ttft / len(records), 6)
