"""`KVTierConnector` on a Mamba hybrid whose blocks span several hash blocks.

A hybrid model's blocks are large (vLLM sizes the attention block so that its page holds
a Mamba state, and makes `mamba_block_size` that size in "align" mode); with
`--prefix-match-unit` finer than them, vLLM 0.33 hashes every `prefix_match_unit` tokens
and, for the Mamba group, keeps a state where the prompt's last hash boundary falls
inside a block: its scheduler ends a prefill chunk there, and its `MambaManager` keys
the state block under the partial hash of that boundary (a "partial tail"). When the
request goes on, the next step's allocation moves that key to a fresh block and queues
a copy of the state into it (`kv_cache_block_copies`, run by the model runner before
the connector's calls), offers that block to the connector as a hand-off, and frees it:
the copy sits in the GPU free queue under the partial key, in no request's table.

kvtier's hits land on whole blocks of such a state group (`KVLayout` allows hash-block
hits only beside state groups of the hash block size), so it stores whole state blocks
and drops partial-tail keys it could never serve (`dropped_partial_state`). When the
model runner raises before the copy ran (before binding the connector's metadata too),
vLLM leaves the unfilled copy in its free queue under the partial key: lazy mode's walk
stored it there, a tier block of the wrong state.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest

pytest.importorskip("vllm")

import test_vllm_random_ops
from busy_steps import busy_steps
from forward_faults import drain_deferred_frees
from gpu_eviction import evict_from_gpu
from kvtier_vllm import check_quiescent, drain, kvtier_harness, scheduler_side
from random_ops import Engine
from table_mirror import audit_tier
from test_vllm_mamba import run_checked
from test_vllm_random_ops import explore
from vllm.v1.request import RequestStatus
from vllm_engine import KVGroupDef
from vllm_harness import VllmHarness, shared_prefix_prompts

from kvtier.core.kv_groups import GroupKind

COARSE = (KVGroupDef(64), KVGroupDef(64, mamba=True))
UNIT = 16  # vLLM's prefix_match_unit: the hash block size
PROMPTS = shared_prefix_prompts(4, prefix_len=64, suffix_len=40, num_prefixes=2)  # 104 tokens
FILLERS = shared_prefix_prompts(6, prefix_len=64, suffix_len=3, num_prefixes=6, seed=7)
EVICTING_FILLERS = shared_prefix_prompts(30, prefix_len=64, suffix_len=3, num_prefixes=30, seed=7)


def coarse_harness(store_mode: str, **overrides: Any) -> VllmHarness:
    overrides.setdefault("num_gpu_blocks", 16)
    return kvtier_harness(
        kv_groups=COARSE,
        block_size=64,
        prefix_match_unit=UNIT,
        extra={"store_mode": store_mode},
        **overrides,
    )


def test_vllm_keeps_and_copies_a_partial_tail_state_and_kvtier_sees_whole_blocks() -> None:
    harness = coarse_harness("eager")
    try:
        assert harness.scheduler.kv_cache_manager.coordinator.enable_partial_hash_hits
        layout = scheduler_side(harness).layout
        assert [(g.kind, g.block_size) for g in layout.groups] == [
            (GroupKind.FULL_ATTENTION, 64),
            (GroupKind.STATE, 64),
        ]
        assert layout.hash_block_size == UNIT
        assert not layout.supports_fine_grained_hits
        harness.add_request("r", PROMPTS["req-0"], max_tokens=4)
        chunks, copies = [], []
        for record in busy_steps(harness):
            chunks += record.num_scheduled_tokens.values()
            copies += record.scheduler_output.kv_cache_block_copies or ()
        # A 64-token chunk, one to the last hash boundary of the prompt (96), the rest.
        assert chunks[:3] == [64, 32, 8], chunks
        assert len(copies) == 1, copies
    finally:
        harness.close()


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_whole_states_come_back_from_the_tier_and_partial_tails_are_dropped(
    store_mode: str,
) -> None:
    harness = coarse_harness(store_mode, num_gpu_blocks=24)
    try:
        totals = run_checked(harness, PROMPTS, max_tokens=20)
        assert totals["handoff_outcome.dropped_partial_state"] > 0, totals
        assert totals["handoff_outcome.stored"] > 0, totals
        evict_from_gpu(
            harness, PROMPTS, lambda filler: run_checked(harness, filler), EVICTING_FILLERS
        )
        again = {f"again-{r}": p for r, p in PROMPTS.items()}
        totals = run_checked(harness, again, max_tokens=3)
        # The tier serves the whole first block, its state included (checked at admission),
        # to the first request of each prefix at least, and never a partial tail (96).
        hits = [harness.admissions[r] for r in again]
        assert all(local + external >= 64 for local, external in hits), hits
        assert all(external in (0, 64) for _, external in hits), hits
        assert sum(external == 64 for _, external in hits) >= 2, hits
        assert totals["loaded_blocks"] > 0, totals
        check_quiescent(harness)
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) > 0
    finally:
        harness.close()


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_a_partial_tail_copy_a_fault_skipped_never_reaches_the_tier(store_mode: str) -> None:
    """The model runner raises before the step's block copies ran (`_update_states`,
    before binding the connector's metadata): vLLM aborts every request, and the copy's
    block stays in its free queue, unfilled, under the partial tail's key.

    Old code: lazy mode's walk stored it; the audit found "position 95 (group 1, ...)
    holds KV of another prefix" in the CPU tier.
    """
    harness = coarse_harness(store_mode)
    scheduler = harness.scheduler
    try:
        harness.add_request("r", PROMPTS["req-0"], max_tokens=8)
        while scheduler.requests["r"].num_computed_tokens < 96:
            harness.step()
        failed = scheduler.schedule()  # the copy's step: the model runner raises first
        (copy,) = failed.kv_cache_block_copies or ()
        target = scheduler.kv_cache_manager.block_pool.blocks[copy.dst_block_id]
        assert target.block_hash_num_tokens == 96  # the partial tail's key moved there
        scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        drain_deferred_frees(harness)  # the failed step is never processed
        assert target.block_hash_num_tokens == 96  # still keyed (the store planned for
        # its hand-off, in the plan no rank bound, fails when a rank binds the next one)
        totals: collections.Counter[str] = collections.Counter()
        for filler in FILLERS.items():  # the lazy walk visits the free queue
            totals += run_checked(harness, dict([filler]))
        drain(harness)
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) > 0
        if store_mode == "lazy":  # the walk visited the copy
            assert totals["store_outcome.dropped_partial_state"] > 0, totals
    finally:
        harness.close()


# 32-token blocks: the random prompts' prefixes (whole 16-token blocks) end on them often.
COARSE_32 = (KVGroupDef(32), KVGroupDef(32, mamba=True))


@pytest.mark.parametrize(
    "engine",
    [
        Engine("coarse_eager", kv_groups=COARSE_32, num_gpu_blocks=16, prefix_match_unit=UNIT),
        Engine(  # partial keys' events span a hash block (16), no group's block size
            "coarse_eager_events",
            kv_groups=COARSE_32,
            num_gpu_blocks=16,
            prefix_match_unit=UNIT,
            events=True,
        ),
        Engine(
            "coarse_lazy_async",
            "lazy",
            async_batches=1,
            kv_groups=COARSE_32,
            num_gpu_blocks=16,
            prefix_match_unit=UNIT,
        ),
    ],
    ids=lambda engine: engine.name,
)
def test_random_operations_on_a_coarse_mamba_hybrid_serve_correct_states(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_vllm_random_ops's operations, faults included (a forward that raises runs
    its step's block copies first, as vLLM's model runner does): every tier block is
    audited against its key (a state against the state of its key's last token) and
    every prompt replayed."""
    monkeypatch.setattr(test_vllm_random_ops, "OPS", test_vllm_random_ops.OPS_WITH_FAULTS)
    totals = explore(engine, 12)
    assert totals["audited_tier_blocks"] > 0
    if engine.events:  # the driver checked each event's span (partial keys: one hash block)
        assert totals["stored_events_partial"] > 0
    assert totals["replay_hit_tokens"] > 0
    assert totals["faults"] > 0
    assert totals["faults_v2"] > 0
